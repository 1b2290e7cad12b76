"""Virtual Token Counting: each tenant's received service (weighted prompt + output tokens over its weight), decayed, in a bounded table.

Dispatch picks the backlogged tenant with the least service, so a tenant that floods gets no
more than the others once they ask. A tenant that starts asking is lifted to the least
service among those already waiting, or to that of the tenant served last (VTC's rule: time
spent idle earns no credit to spend later; the controller applies it). Service decays with a half-life, so the past stops counting. The table holds at most
`max_tenants` tenants; the least recently seen one without queued requests makes room for a
new one, and when none can, the newcomer shares the flow OTHER: an attacker who sends a
million fairness ids gets one flow, not a million.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

OTHER = "other"


class VirtualCounters:
    def __init__(
        self,
        max_tenants: int,
        half_life: float,
        clock: Callable[[], float] = time.monotonic,
        busy: Callable[[str], bool] = lambda tenant: False,
    ):
        self.max_tenants = max_tenants
        self.half_life = half_life
        self.clock = clock
        self.busy = busy  # a tenant with queued requests is never evicted
        self._table: OrderedDict[str, tuple[float, float]] = OrderedDict()  # tenant -> (value, at)
        self._local: dict[str, float] = {}  # service given here since the last take_local()
        self.on_evict: Callable[[str], None] = lambda tenant: None

    def __len__(self) -> int:
        return len(self._table)

    def __contains__(self, tenant: str) -> bool:
        return tenant in self._table

    def tenants(self) -> list[str]:
        return list(self._table)

    def tenant(self, name: str) -> str:
        """The flow `name` is counted in: its own, or OTHER when the table is full of busy tenants."""
        if name in self._table:
            self._table.move_to_end(name)
            return name
        if len(self._table) >= self.max_tenants and not self._evict():
            name = OTHER
            if name in self._table:
                self._table.move_to_end(name)
                return name
        self._table[name] = (0.0, self.clock())
        return name

    def _evict(self) -> bool:
        for old in self._table:
            if old != OTHER and not self.busy(old):
                del self._table[old]
                self._local.pop(old, None)
                self.on_evict(old)
                return True
        return False

    def value(self, tenant: str) -> float:
        v, at = self._table.get(tenant, (0.0, None))
        if at is None:
            return 0.0
        return v * 0.5 ** (max(0.0, self.clock() - at) / self.half_life)

    def _add(self, tenant: str, amount: float) -> None:
        if tenant in self._table:
            self._table[tenant] = (self.value(tenant) + amount, self.clock())

    def charge(self, tenant: str, amount: float) -> None:
        """Service given here (virtual tokens, already over the tenant's weight)."""
        if amount > 0 and tenant in self._table:
            self._add(tenant, amount)
            self._local[tenant] = self._local.get(tenant, 0.0) + amount

    def add_remote(self, tenant: str, amount: float) -> None:
        """Service the other routers gave the tenant (router/flow/shared_counters.py)."""
        if amount > 0:
            self._add(tenant, amount)

    def lift(self, tenant: str, floor: float) -> None:
        """VTC's lift: a tenant that starts waiting counts at least `floor`."""
        if tenant in self._table and self.value(tenant) < floor:
            self._table[tenant] = (floor, self.clock())

    def take_local(self) -> dict[str, float]:
        """The service given here since the last call (for the sync with the other routers)."""
        out, self._local = self._local, {}
        return out

    def give_back_local(self, local: dict[str, float]) -> None:
        """A sync that failed: its deltas go out with the next one."""
        for tenant, amount in local.items():
            if tenant in self._table:
                self._local[tenant] = self._local.get(tenant, 0.0) + amount
