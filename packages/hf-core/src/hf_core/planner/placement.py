"""Placements (which models share devices) and allocations (how many devices each set gets).

``get_placements`` and ``enum_alloc`` of Algorithm 1: placements are the set partitions of the
models (Bell numbers: 1, 2, 5, 15, 52 for 1..5 models); a colocated set gets either a divisor of
a node (several such sets share a node) or whole nodes, so tensor-parallel groups never
straddle a node boundary and sets never share a device.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TypeVar

T = TypeVar("T")

Placement = tuple[tuple[str, ...], ...]
"""Colocated sets, each a tuple of roles."""


def set_partitions(items: Sequence[T]) -> Iterator[tuple[tuple[T, ...], ...]]:
    """Every partition of ``items`` into non-empty blocks, each exactly once.

    Restricted-growth strings: item ``i`` joins one of the blocks opened so far or opens the
    next one, so block order is canonical and nothing repeats.
    """
    items = list(items)
    if not items:
        yield ()
        return

    def grow(i: int, blocks: list[list[T]]) -> Iterator[tuple[tuple[T, ...], ...]]:
        if i == len(items):
            yield tuple(tuple(b) for b in blocks)
            return
        for block in blocks:
            block.append(items[i])
            yield from grow(i + 1, blocks)
            block.pop()
        blocks.append([items[i]])
        yield from grow(i + 1, blocks)
        blocks.pop()

    yield from grow(0, [])


def bell(n: int) -> int:
    """The n-th Bell number (number of set partitions), via the Bell triangle."""
    row = [1]
    for _ in range(n):
        nxt = [row[-1]]
        for value in row:
            nxt.append(nxt[-1] + value)
        row = nxt
    return row[0]


def allowed_sizes(total: int, per_node: int) -> tuple[int, ...]:
    """Device counts a set may get: proper divisors of a node, or whole nodes."""
    partial = [k for k in range(1, per_node) if per_node % k == 0]
    whole = list(range(per_node, total + 1, per_node))
    return tuple(k for k in partial + whole if k <= total)


def assign_nodes(
    sizes: Sequence[int], per_node: int, nodes: int
) -> list[list[tuple[int, int]]] | None:
    """Concrete ``(node, devices)`` slots for each set, or ``None`` if they do not pack.

    Whole-node sets take consecutive nodes; sub-node sets are packed first-fit-decreasing into
    the nodes left, so a runner can reserve each set on the nodes named here.
    """
    slots: list[list[tuple[int, int]]] = [[] for _ in sizes]
    node = 0
    for i, size in enumerate(sizes):
        if size >= per_node:
            slots[i] = [(node + j, per_node) for j in range(size // per_node)]
            node += size // per_node
    free: list[tuple[int, int]] = []  # (node, free devices)
    order = sorted((i for i, s in enumerate(sizes) if s < per_node), key=lambda i: -sizes[i])
    for i in order:
        for j, (n, room) in enumerate(free):
            if room >= sizes[i]:
                free[j] = (n, room - sizes[i])
                slots[i] = [(n, sizes[i])]
                break
        else:
            free.append((node, per_node - sizes[i]))
            slots[i] = [(node, sizes[i])]
            node += 1
    return slots if node <= nodes else None


def allocations(
    options: Sequence[Sequence[int]], total: int, per_node: int
) -> Iterator[tuple[int, ...]]:
    """Every way to hand all ``total`` devices to the sets that packs onto nodes
    (``enum_alloc`` of Algorithm 1).

    ``options[i]`` lists the device counts set ``i`` may get (allowed sizes on which it fits,
    so its first entry is the set's minimal allocation ``A_min``); infeasible counts never
    reach the scorer, and a branch stops as soon as the remaining sets' minima cannot fit.
    """
    choices = [sorted(opts) for opts in options]
    if any(not c for c in choices):
        return
    nodes = total // per_node
    rest_min = [sum(c[0] for c in choices[i:]) for i in range(len(choices))] + [0]

    def grow(i: int, left: int, acc: list[int]) -> Iterator[tuple[int, ...]]:
        if i == len(choices) - 1:
            if left in choices[i] and assign_nodes([*acc, left], per_node, nodes) is not None:
                yield (*acc, left)
            return
        for size in choices[i]:
            if size + rest_min[i + 1] > left:
                break
            acc.append(size)
            yield from grow(i + 1, left - size, acc)
            acc.pop()

    if choices:
        yield from grow(0, total, [])
