"""A link in the α-β model: a message of n bytes takes α + n·β seconds.

α is the per-message latency in seconds; β the inverse of the per-direction bandwidth, in seconds per
byte. Source of the model: Hockney 1994, "The communication challenge for MPP: Intel Paragon and Meiko
CS-2", Parallel Computing 20(3); the notation follows Thakur, Rabenseifner & Gropp 2005.
"""

from __future__ import annotations

import dataclasses
import math

from commlab import checks

__all__ = ["Link", "flows_per_nic"]


@dataclasses.dataclass(frozen=True)
class Link:
    """One link type.

    Attributes:
        alpha_s: latency per message, seconds (>= 0).
        beta_s_per_byte: inverse per-direction bandwidth, seconds per byte (>= 0).
        name: a label for tables and figures.

    Raises:
        ValueError: a negative or non-finite α or β.
    """

    alpha_s: float
    beta_s_per_byte: float
    name: str = ""

    def __post_init__(self):
        for field in ("alpha_s", "beta_s_per_byte"):
            checks.number(field, getattr(self, field), least=0, where=f"Link {self.name}".rstrip())

    @classmethod
    def from_bandwidth(cls, bytes_per_s: float, alpha_s: float, name: str = "") -> "Link":
        """A link of ``bytes_per_s`` per direction and latency ``alpha_s``.

        Raises:
            ValueError: ``bytes_per_s <= 0``.
        """
        checks.number("bytes_per_s", bytes_per_s, above=0, finite=False)
        return cls(alpha_s=alpha_s, beta_s_per_byte=1.0 / bytes_per_s, name=name)

    @property
    def bytes_per_s(self) -> float:
        """Per-direction bandwidth in bytes/s (inf for β = 0)."""
        return math.inf if self.beta_s_per_byte == 0 else 1.0 / self.beta_s_per_byte

    def seconds(self, nbytes: float) -> float:
        """Time of one message of ``nbytes`` bytes: α + nbytes·β."""
        return self.alpha_s + nbytes * self.beta_s_per_byte


def flows_per_nic(senders_per_node: float, nics_per_node: int) -> float:
    """How many flows each NIC of a node carries when ``senders_per_node`` flows leave the node at once:
    ``max(1, senders_per_node / nics_per_node)``, the factor by which a flow's inter-node β grows.

    The flows are assumed to spread evenly over the node's NICs (a rail-optimised node: GPU g sends through
    its own NIC while there are NICs enough); a NIC never carries less than its one flow.

    Raises:
        ValueError: ``nics_per_node < 1`` or ``senders_per_node < 0``.
    """
    if not nics_per_node >= 1:
        raise ValueError(f"nics_per_node must be >= 1, got {nics_per_node!r}")
    if not senders_per_node >= 0:
        raise ValueError(f"senders_per_node must be >= 0, got {senders_per_node!r}")
    return max(1.0, senders_per_node / nics_per_node)
