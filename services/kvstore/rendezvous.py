"""Rendezvous (highest-random-weight) hashing of block hashes over kvstore nodes.

Each (node, block) pair gets a score; the block lives on the node with the highest score. When a node
leaves, only its own blocks move, and every client computes the same owner without coordination.
"""
from __future__ import annotations

import hashlib


def _score(node: str, block_hash: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(node.encode() + b"\0" + block_hash, digest_size=8).digest(), "big")


def rank_nodes(block_hash: bytes, nodes: list[str]) -> list[str]:
    """Nodes in preference order for `block_hash` (ties, practically impossible, go by name)."""
    return sorted(nodes, key=lambda n: (-_score(n, block_hash), n))


def node_for(block_hash: bytes, nodes: list[str]) -> str:
    """The node that owns `block_hash` among `nodes`."""
    if not nodes:
        raise ValueError("node_for: no kvstore nodes (check --kvstore addresses and that they are up)")
    return min(nodes, key=lambda n: (-_score(n, block_hash), n))
