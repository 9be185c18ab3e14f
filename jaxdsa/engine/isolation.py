"""Finding the request whose inputs break engine steps, so that only it fails (plain Python).

Requests are validated when they are added, but a step can still raise (an input no check
foresaw, a device error). Failing every request in the batch would let one client take down
all the others, so the engine narrows the failure down instead, as a bisection over the
requests of the step that raised:

* they are split into groups, tested one at a time: while a group is under test only its
  members are scheduled; a member is cleared once it has sampled a token (that is when every
  one of its inputs has been through a step), and the group once every member is cleared;
* the first split retries the step without its newest admissions (the usual suspects), then
  tests those; later splits halve the requests of the step that raised;
* a step that raises with a single request in it fails that request.

Each failure halves the suspects, so a request that breaks every step it is in is found after
about log2(batch) failed steps, and the others lose no tokens: a failed step commits nothing.
A failure that does not come back (a transient device error) clears every group and serving
goes on as before.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jaxdsa.engine.request import Request, Status


@dataclasses.dataclass
class _Group:
    """Requests tested together, with how many tokens each had when the test began."""

    members: list[Request]
    tokens_before: dict[int, int]  # id(request) -> len(request.output)

    @classmethod
    def of(cls, members: Sequence[Request]) -> _Group:
        return cls(list(members), {id(r): len(r.output) for r in members})

    def pending(self) -> list[Request]:
        """Members still to clear: unfinished and without a token sampled since the test began."""
        return [
            r
            for r in self.members
            if r.status is not Status.FINISHED and len(r.output) == self.tokens_before[id(r)]
        ]


class Quarantine:
    """The groups of suspects still to test, the one tested now last."""

    def __init__(self) -> None:
        self._groups: list[_Group] = []

    def under_test(self) -> set[Request] | None:
        """The requests the next step may hold: the pending members of the group under test, or
        None (every request) when no group is left."""
        while self._groups:
            pending = self._groups[-1].pending()
            if pending:
                return set(pending)
            self._groups.pop()  # cleared
        return None

    def step_failed(self, requests: Sequence[Request], newest: Sequence[Request]) -> Request | None:
        """A step holding ``requests`` (``newest``: those it admitted) raised. Returns the request
        to fail when it ran alone; otherwise splits them into groups to test, and returns None."""
        if len(requests) == 1:
            return requests[0]
        newest_ids = {id(r) for r in newest}
        older = [r for r in requests if id(r) not in newest_ids]
        if not self._groups and older and len(older) < len(requests):
            halves = [older, [r for r in requests if id(r) in newest_ids]]
        else:
            half = len(requests) // 2
            halves = [list(requests[:half]), list(requests[half:])]
        self._groups += [_Group.of(halves[1]), _Group.of(halves[0])]  # the first half is tested first
        return None
