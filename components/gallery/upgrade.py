"""Transitional: the names of ``ending``, ``reversal``, ``status`` and ``garbage`` under their old
module, until every caller imports them from where they live."""

from components.gallery.ending import *  # noqa: F401,F403
from components.gallery.ending import decision, finish, interrupted_ending, mark_registry_recorded, reject, rejection  # noqa: F401
from components.gallery.ending import write_decision as record_decision  # noqa: F401
from components.gallery.garbage import collect_garbage  # noqa: F401
from components.gallery.reversal import *  # noqa: F401,F403
from components.gallery.reversal import (  # noqa: F401
    ABORTED, ROLLBACK, ROLLED_BACK, abort, abortable, aborted, interrupted_rollback, mark_rollback_recorded, progress,
    rollback, rollback_target, rolled_back, start_over, who,
)
from components.gallery.status import FAILED_SHOWN, status  # noqa: F401
