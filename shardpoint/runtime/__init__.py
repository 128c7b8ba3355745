"""Runtime services every layer uses: the collective handshake, rank-local checks, timings and traces, progress, optional dependencies."""

__all__: list[str] = []
