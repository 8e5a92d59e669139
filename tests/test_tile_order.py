"""The prefill kernel's tile list for CUDA graphs: every tile once, the most keys first."""
import numpy as np

from kvmesh.kernels.tile_order import tile_list


def test_every_tile_once_heaviest_first():
    rng = np.random.default_rng(7)
    for _ in range(20):
        b = int(rng.integers(1, 12))
        prefix = rng.integers(0, 3000, b)
        new = rng.integers(1, 700, b)
        new[rng.random(b) < 0.3] = 1  # decode rows: one tile of one token
        entries = tile_list(prefix, new, 42)
        seq, tile = entries >> 16, entries & 0xFFFF
        want = sorted((s, t) for s in range(b) for t in range(-(-int(new[s]) // 42)))
        assert sorted(zip(seq.tolist(), tile.tolist())) == want
        keys = prefix[seq] + np.minimum((tile + 1) * 42, new[seq])
        assert (np.diff(keys) <= 0).all()


def test_ties_keep_sequence_then_tile_order():
    # a decode row over 100 keys ties a fresh prompt's second tile (100 keys): the sequence first wins
    assert tile_list([99, 0], [1, 150], 50).tolist() == [1 << 16 | 2, 0, 1 << 16 | 1, 1 << 16 | 0]


def test_no_sequences():
    assert tile_list([], [], 64).shape == (0,)
