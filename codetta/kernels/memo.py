"""Host-side memos keyed on call shapes, bounded: a training run whose token count changes
every step (variable sequence lengths) meets a new shape each step, and a memo that kept
them all would grow for as long as it ran. Each memo here forgets everything at once when
it reaches its limit (what it holds is rebuilt on the next call, to the same value)."""

from __future__ import annotations

LIMIT = 4096  # entries a memo keyed on call shapes holds before it forgets them all


class Memo(dict):
    """A dict cleared as a whole when a new key would make it hold more than ``limit``
    entries. Only ``memo[key] = value`` is bounded (not ``update`` / ``setdefault``)."""

    def __init__(self, limit: int = LIMIT):
        super().__init__()
        self.limit = limit

    def __setitem__(self, key, value):
        if len(self) >= self.limit and key not in self:
            self.clear()
        super().__setitem__(key, value)

    def __reduce__(self):  # (copy / pickle: the limit first, then the entries)
        return type(self), (self.limit,), None, None, iter(self.items())


class MemoSet(set):
    """A set cleared as a whole when a new element would make it hold more than ``limit``."""

    def __init__(self, limit: int = LIMIT):
        super().__init__()
        self.limit = limit

    def add(self, item):
        if len(self) >= self.limit and item not in self:
            self.clear()
        super().add(item)

    def __reduce__(self):
        return type(self), (self.limit,), {"items": list(self)}

    def __setstate__(self, state):
        self.update(state["items"])
