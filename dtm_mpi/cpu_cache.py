"""The CPU's cache as the numpy code sees it: how many elements a pass over arrays can take
at a time and stay in a core's L2 cache. Read once from ``/sys`` at import; pure otherwise
(standard library only), so every layer can use it: the fused chains of the runtime
(:mod:`dtm_mpi.runtime.chunked`) and the quantized collectives (:mod:`dtm_mpi.comm.quantized`)."""

from __future__ import annotations

__all__ = ["CHUNK_ELEMS"]


def _chunk_elems() -> int:
    """Elements per chunk: a sixteenth of a core's L2 cache in bytes (four float32 arrays of
    a chain's inputs and intermediates fill it), within 16,384..65,536; 16,384 where the
    cache size is not known. Measured on a 2-core AMD EPYC with 1 MiB of L2 per core: the
    GPT's chains 20-25% faster in chunks of 65,536 than of 16,384, the MLP's updates too."""
    cache = "/sys/devices/system/cpu/cpu0/cache/index2/"
    try:
        with open(cache + "level", encoding="ascii") as fh:
            if fh.read().strip() != "2":
                return 16384
        with open(cache + "size", encoding="ascii") as fh:
            text = fh.read().strip().upper()
        size = int(text.rstrip("KMG")) << {"K": 10, "M": 20, "G": 30}.get(text[-1:], 0)
    except (OSError, ValueError):
        return 16384
    return max(16384, min(65536, size // 16))


CHUNK_ELEMS = _chunk_elems()
"""Elements per cache-sized chunk of a pass over float arrays (:func:`_chunk_elems`)."""
