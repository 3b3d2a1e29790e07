"""The parts of ``@locked`` (see ``django_mongolock.decorators``), one job per module.

``keys``: key templates; ``kinds``: function, view or command; ``call``: one call under
its lock; ``held``: iterating and releasing; ``busy``: what a busy call answers;
``stopping``: ``on_lost="exit"``; ``coalesce``: the run requests of ``on_busy="coalesce"``.
"""
