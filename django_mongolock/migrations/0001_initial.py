"""The unmanaged ``Lock`` model: permission and content type rows, no table."""

from __future__ import annotations

from django.db import migrations, models


class Migration(migrations.Migration):
    initial = True

    dependencies = []

    operations = [
        migrations.CreateModel(
            name="Lock",
            fields=[
                (
                    "id",
                    models.AutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
            ],
            options={
                "verbose_name": "lock",
                "verbose_name_plural": "locks",
                "permissions": [
                    ("view_lock", "Can view locks"),
                    ("release_lock", "Can force-release locks"),
                ],
                "managed": False,
                "default_permissions": (),
            },
        ),
    ]
