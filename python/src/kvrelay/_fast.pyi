# The optional compiled helper (_fast.c): each call answers NotImplemented for an input it does
# not take as is, and the caller then takes the ctypes path.
from types import NotImplementedType

class SnapshotRef:
    # made by admit() only: the type cannot be instantiated from Python
    @property
    def ptr(self) -> int | None: ...

def bind(admit: int, submit: int, release: int) -> None: ...
def admit(admission: int, raw: object) -> tuple[int, int, str, SnapshotRef | None] | int | NotImplementedType: ...
def submit(
    agent: int,
    endpoint: bytes,
    names: object,
    held: object,
    dst_blocks: object,
    deadline_ms: object,
    callbacks: int,
    out: int,
) -> int | NotImplementedType: ...
