"""`--dist loadgroup` that survives a crashed worker (pytest-xdist 3.8.0, the newest release).

When a worker dies (a segfault in a native library, the OOM killer), 3.8.0's LoadScopeScheduling
puts the dead worker's whole workload back on the queue, finished groups and the test it died on
included. A finished group goes out as an empty unit that never completes, and a replacement
worker handed a single test waits forever for a second: the run hangs until CI's deadline
instead of reporting the crash (pytest-dev/pytest-xdist#1323, #1327, #1378; fixed upstream after
3.8.0, unreleased). This scheduler requeues only what was not run, counts the test that crashed
as done (xdist has already reported it failed), gives a worker two tests or the order to finish,
and schedules a replacement worker only once it has collected.
"""
from __future__ import annotations

from xdist.scheduler import LoadGroupScheduling


class CrashSafeLoadGroup(LoadGroupScheduling):
    def remove_node(self, node):
        workload = self.assigned_work.pop(node)
        pending = {scope: unit for scope, unit in workload.items() if not all(unit.values())}
        if not pending:
            return None
        crashitem = next(nodeid for unit in pending.values() for nodeid, done in unit.items() if not done)
        pending[self._split_scope(crashitem)][crashitem] = True
        self.workqueue.update({scope: unit for scope, unit in pending.items() if not all(unit.values())})
        for other in self.assigned_work:
            self._reschedule(other)
        return crashitem

    def _reschedule(self, node):
        if node not in self.registered_collections:
            return  # a replacement still collecting: scheduled when its collection arrives
        try:
            super()._reschedule(node)
            # A worker runs a test only once it holds the next one or the order to finish.
            while self.workqueue and not node.shutting_down and self._pending_of(self.assigned_work[node]) < 2:
                self._assign_work_unit(node)
            if not self.workqueue and not node.shutting_down:
                node.shutdown()
        except OSError:
            pass  # the worker died after its last report: remove_node requeues what it held
