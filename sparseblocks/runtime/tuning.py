"""Tuning as data: the frozen config objects every op takes as ``config=``.

Each op's ``config.py`` declares one frozen dataclass of its knobs, decorated
with `tuning`. Fields that are tables (a value per block size, dtype, ...) are
given as dicts and stored as `Table`, a read-only, hashable mapping, and sets
as frozensets, so that a config can key the compile cache and the kept plans:
a kernel made under one config is never reused under another.

    from dataclasses import replace
    fast = replace(DEFAULT, v5_stages=4)      # a variant; DEFAULT is untouched
    bsmm.forward(x, w, layout, config=fast)
"""

import dataclasses


class Table(dict):
    """A read-only, hashable dict (a config field's value by block size, dtype, ...)."""

    __slots__ = ("_hash",)

    def __hash__(self):
        try:
            return self._hash
        except AttributeError:
            self._hash = hash(frozenset(self.items()))
            return self._hash

    def _read_only(self, *args, **kwargs):
        raise TypeError("a config's table is read-only: use dataclasses.replace with a new dict")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _read_only

    def __repr__(self):
        return f"Table({dict.__repr__(self)})"


def _frozen(value):
    if isinstance(value, Table) and all(_frozen(v) is v for v in value.values()):
        return value
    if isinstance(value, dict):
        return Table({k: _frozen(v) for k, v in value.items()})
    if isinstance(value, (set, frozenset)):
        return frozenset(value)
    if isinstance(value, list):
        return tuple(_frozen(v) for v in value)
    return value


def tuning(cls):
    """Make `cls` a frozen dataclass whose dict, set and list fields are stored frozen, with its
    hash computed once (configs key every compile-cache and kept-plan lookup); a field declared
    ``dict`` given anything else is a TypeError naming it."""

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.type in (dict, "dict") and not isinstance(value, dict):
                raise TypeError(f"{field.name}: expected a dict (a value per block size, dtype, ...), got {value!r}")
            object.__setattr__(self, field.name, _frozen(value))
        object.__setattr__(self, "_hash", hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self))))
        check = getattr(self, "check", None)
        if check is not None:
            check()

    def __hash__(self):
        return self._hash

    cls.__post_init__ = __post_init__
    cls.__hash__ = __hash__
    return dataclasses.dataclass(frozen=True, eq=True, unsafe_hash=False)(cls)


def config_checker(cls):
    """``as_config(config)`` for a config class: ``config`` checked, or the class's module's
    ``DEFAULT`` (read at each call, so that a test may replace it) where None."""
    import sys

    module = sys.modules[cls.__module__]

    def as_config(config):
        if config is None:
            return module.DEFAULT
        if not isinstance(config, cls):
            raise TypeError(f"config: expected a {cls.__name__}, got {type(config).__name__}")
        return config

    return as_config


def default_field(table):
    """A dict-valued field's default (dataclasses takes no mutable default)."""
    return dataclasses.field(default_factory=lambda: Table(table))
