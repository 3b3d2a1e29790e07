"""Beyond the mutex: semaphores, lock groups and leader election, built on a lock source.

A semaphore is a shared lock with a limit; a group takes several exclusive locks in one
global order; an election is an exclusive lock that the refresher thread keeps trying to
take (campaigning) and keeps alive once taken. Each recipe is handed its source (a
``LockManager``, see ``LockSource``) and uses only its public calls and, for holders
tagged in the document, the acquire of ``acquiring.py``: none imports the manager. A new
recipe is a new module here.
"""

from django_mongolock.recipes.election import Election
from django_mongolock.recipes.group import LockGroup
from django_mongolock.recipes.semaphore import Semaphore
from django_mongolock.recipes.source import LockSource

__all__ = ["Election", "LockGroup", "LockSource", "Semaphore"]
