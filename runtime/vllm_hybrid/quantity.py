"""Memory quantities as Kubernetes writes them (64Gi, 1.5G, 4096) <-> bytes: the one parser of the runtime's plan
and the operator's pods, so both round a spec's memory the same way."""
from __future__ import annotations

import math
import re
from fractions import Fraction

_UNITS = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15,
          "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50}
_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P)?$")


def to_bytes(quantity: str | int | float) -> int:
    """Bytes of a positive quantity (a plain number is bytes); ValueError otherwise."""
    if isinstance(quantity, (int, float)) and not isinstance(quantity, bool):
        value, unit = Fraction(quantity), ""
    elif match := _QUANTITY.match(str(quantity).strip()):
        value, unit = Fraction(match.group(1)), match.group(2) or ""
    else:
        raise ValueError(f"not a memory quantity: {quantity!r}")
    if value <= 0:
        raise ValueError(f"not a memory quantity: {quantity!r}")
    # Fraction, not float: 1.1Gi must not become 1181116006.4000001 bytes; round up like the kubelet.
    return math.ceil(value * _UNITS[unit])


def from_bytes(n: int) -> str:
    """The largest binary unit that divides exactly, so 64Gi + 32Gi reads 96Gi."""
    for unit in ("Pi", "Ti", "Gi", "Mi", "Ki"):
        if n and n % _UNITS[unit] == 0:
            return f"{n // _UNITS[unit]}{unit}"
    return str(n)
