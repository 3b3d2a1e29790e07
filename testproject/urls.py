from django.contrib import admin
from django.urls import path

from testproject import views

urlpatterns = [
    path("admin/", admin.site.urls),
    path("invoices/<int:pk>/render/", views.render_invoice, name="invoice-render"),
]
