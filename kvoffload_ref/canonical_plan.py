"""The worker's canonical mode (R24), pure: which mappings a worker runs with, and what they ask of the layout.

Theory of operation
-------------------
In canonical mode (vLLM's ``canonical_layout``, PRs #48408, #48414, #51688) every layout tensor ``t`` has this
rank's :class:`~kvoffload_ref.canonical.PageMapping`. The CPU sub-block of tensor ``t`` is then the *canonical
page* (``mappings[t].canonical_page_size`` bytes) instead of the GPU page, so a CPU row of that tensor is
``canonical_page * blocks_per_chunk`` bytes; a block's copy is the mapping's fragments (``fragments()``, unrolled
once per mapping) at the block's base addresses; a store copies a block only when this rank writes its CPU
canonical page ``chunk_id * blocks_per_chunk + j`` (``is_writer``), a load always copies. This module holds the
value the workers take (:class:`CanonicalLayout`), its checks against a layout (:func:`check_canonical`, R7),
the layout a canonical region is built for (:meth:`CanonicalLayout.cpu_layout`) and the writer mask the
vectorized planner uses (:func:`writer_mask`). The plain rule is ``placement.canonical_moves``; the vectorized
one is ``planner.Planner(..., canonical=...)``.

Pure: imports only the mapping model, the specs, errors and validate.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvoffload_ref.canonical import PageMapping, verify_mapping
from kvoffload_ref.errors import InvalidTransferError
from kvoffload_ref.specs import KVCacheLayout, LayerRef
from kvoffload_ref.validate import Int64Array, check_int

__all__ = ["CanonicalLayout", "as_canonical", "check_canonical", "cpu_pages", "writer_mask"]


@dataclasses.dataclass(frozen=True, init=False)
class CanonicalLayout:
    """This rank's canonical mappings, one per layout tensor, each verified (R24) when this is built.

    ``create_worker(..., canonical=...)`` and ``create_reference_worker(..., canonical=...)`` take one (or a plain
    sequence of :class:`PageMapping`, taken as ``CanonicalLayout(tuple(seq))``). Layers aliased onto one tensor
    share its mapping. Build the group's mappings with ``canonical_derive.derive_layer`` (which runs
    ``verify_mappings`` over every rank) and hand each rank its own.

    Attributes:
        mappings: ``mappings[t]`` is this rank's mapping of layout tensor ``t`` (a list is accepted).
        rank: this rank, for the messages of a verification failure.

    Raises:
        InvalidTransferError: ``mappings`` is empty or holds something that is not a PageMapping, or ``rank`` is
            not an int >= 0. MappingError (an InvalidTransferError): a mapping's runs do not cover its local
            page exactly once.
    """

    mappings: tuple[PageMapping, ...]  # Invariant: non-empty; each verified by verify_mapping.
    rank: int = 0  # Invariant: >= 0.

    def __init__(self, mappings: Sequence[PageMapping], rank: int = 0) -> None:
        if isinstance(mappings, (str, bytes)) or not isinstance(mappings, Sequence) or not mappings:
            raise InvalidTransferError("canonical mappings must be a non-empty sequence of PageMapping, one per "
                                       "layout tensor")
        object.__setattr__(self, "mappings", tuple(mappings))
        object.__setattr__(self, "rank", check_int("CanonicalLayout.rank", rank, minimum=0))
        for t, mapping in enumerate(self.mappings):
            if not isinstance(mapping, PageMapping):
                raise InvalidTransferError(f"canonical mappings[{t}] must be a PageMapping, got "
                                           f"{type(mapping).__name__}")
            verify_mapping(f"tensor {t}", self.rank, mapping)  # R24, this rank: its page covered exactly once

    @property
    def canonical_pages(self) -> tuple[int, ...]:
        """The CPU sub-block (canonical page) of each tensor, in bytes."""
        return tuple(m.canonical_page_size for m in self.mappings)

    def cpu_layout(self, layout: KVCacheLayout) -> KVCacheLayout:
        """The layout a canonical-mode region is built for: tensor ``t``'s page is its canonical page, so
        ``HostRegion.allocate(backend, cpu_layout, bpc, n)`` (or ``SharedRegion.open(..., layout=cpu_layout,
        replicated=True)``, every rank seeing the same canonical bytes) makes rows of ``canonical_page * bpc``.

        Args:
            layout: the worker's (GPU) layout; checked against these mappings first.

        Returns:
            A layout with the canonical pages and one whole-page ref per tensor (only its CPU row sizes matter).

        Raises:
            InvalidTransferError: what :func:`check_canonical` raises.
        """
        check_canonical(layout, self)
        pages = self.canonical_pages
        return KVCacheLayout(pages, [[LayerRef(t, page) for t, page in enumerate(pages)]])


def as_canonical(value: object) -> CanonicalLayout | None:
    """The ``canonical=`` argument of a worker as a :class:`CanonicalLayout` (R7: checked before anything is built).

    Args:
        value: None (plain mode), a CanonicalLayout, or a sequence of PageMapping (rank 0 in messages).

    Returns:
        None or the CanonicalLayout.

    Raises:
        InvalidTransferError: anything else, or a mapping that does not verify (see :class:`CanonicalLayout`).
    """
    if value is None or isinstance(value, CanonicalLayout):
        return value
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise InvalidTransferError(f"canonical must be None, a CanonicalLayout or a sequence of PageMapping, got "
                                   f"{type(value).__name__}")
    return CanonicalLayout(tuple(value))


def check_canonical(layout: KVCacheLayout, canonical: CanonicalLayout | None) -> CanonicalLayout | None:
    """R7: the mappings fit the layout: one per tensor, and each ref of tensor ``t`` copies exactly the bytes its
    mapping covers (``ref.page_size_bytes == mappings[t].local_page_size``).

    Returns:
        ``canonical``.

    Raises:
        InvalidTransferError: a count or page size that does not fit.
    """
    if canonical is None:
        return None
    if len(canonical.mappings) != layout.num_tensors:
        raise InvalidTransferError(f"got {len(canonical.mappings)} canonical mappings, expected "
                                   f"{layout.num_tensors} (one per layout tensor)")
    for g, refs in enumerate(layout.groups):
        for i, ref in enumerate(refs):
            local = canonical.mappings[ref.tensor_idx].local_page_size
            if ref.page_size_bytes != local:
                raise InvalidTransferError(
                    f"groups[{g}][{i}].page_size_bytes = {ref.page_size_bytes} does not match the canonical mapping "
                    f"of tensor {ref.tensor_idx} (rank {canonical.rank}): expected its local page, {local} bytes")
    return canonical


def cpu_pages(layout: KVCacheLayout, canonical: CanonicalLayout | None) -> tuple[int, ...]:
    """The CPU sub-block of each tensor: its canonical page in canonical mode, else its GPU page."""
    return layout.tensor_page_bytes if canonical is None else canonical.canonical_pages


def writer_mask(mapping: PageMapping, page_ids: Int64Array) -> npt.NDArray[np.bool_]:
    """Vectorized :meth:`PageMapping.is_writer`: which CPU canonical pages this rank stores.

    Args:
        page_ids: CPU canonical page ids (``chunk_id * blocks_per_chunk + j``), int64 >= 0.

    Returns:
        A bool array as long as ``page_ids``.
    """
    if mapping.num_writers == 1:
        return np.ones(page_ids.shape, dtype=np.bool_)
    return np.asarray(page_ids % mapping.num_writers == mapping.writer_index)
