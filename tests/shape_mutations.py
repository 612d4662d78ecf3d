"""Seeded random mutations of a nested value (a run record's JSON, a checkpoint's
state): type swaps, deletions, wrong lengths, unknown names. Used by
tests/test_record_shapes.py."""
from __future__ import annotations

import random

import torch

OTHER_VALUES = (None, True, -1, 0, 7, 2.5, "x", [], {}, "NoSuchTask", [1, "x"], {"x": 1})


def _children(node) -> list:
    if isinstance(node, dict):
        return list(node)
    if isinstance(node, (list, tuple)):
        return list(range(len(node)))
    return []


def pick_path(value, rng: random.Random) -> tuple:
    """A random path into `value`: each level picks a child at random, and stops
    there with probability 1/3 (so top-level fields are hit as often as leaves)."""
    path, node = (), value
    while _children(node) and (not path or rng.random() > 1 / 3):
        key = rng.choice(_children(node))
        path, node = path + (key,), node[key]
    return path


def _get(value, path):
    for key in path:
        value = value[key]
    return value


def _replace(value, path, new, delete=False):
    """`value` with the node at `path` replaced by `new` (or deleted), tuples rebuilt."""
    if not path:
        return new
    key, rest = path[0], path[1:]
    if isinstance(value, dict):
        out = dict(value)
        if delete and not rest:
            del out[key]
        else:
            out[key] = _replace(value[key], rest, new, delete)
        return out
    items = list(value)
    if delete and not rest:
        del items[key]
    else:
        items[key] = _replace(value[key], rest, new, delete)
    return tuple(items) if isinstance(value, tuple) else items


def mutate(value, rng: random.Random) -> tuple:
    """(a mutated copy of `value`, what was done)."""
    path = pick_path(value, rng)
    while not path:
        path = pick_path(value, rng)
    node = _get(value, path)
    where = ".".join(map(str, path))
    kind = rng.choice(["delete", "swap", "length", "name"])
    if kind == "delete":
        return _replace(value, path, None, delete=True), f"deleted {where}"
    if kind == "length" and isinstance(node, (list, tuple)) and node:
        longer = rng.random() < 0.5
        new = list(node) + [node[-1]] if longer else list(node)[:-1]
        new = tuple(new) if isinstance(node, tuple) else new
        return _replace(value, path, new), f"{where}: {'one more item' if longer else 'one item less'}"
    if kind == "length" and isinstance(node, torch.Tensor) and node.numel() > 1:
        return _replace(value, path, node.flatten()[:-1]), f"{where}: a tensor one element short"
    if kind == "name" and isinstance(node, str):
        return _replace(value, path, "NoSuchTask"), f"{where}: 'NoSuchTask'"
    new = rng.choice([v for v in OTHER_VALUES if type(v) is not type(node)])
    return _replace(value, path, new), f"{where}: {type(node).__name__} -> {new!r}"
