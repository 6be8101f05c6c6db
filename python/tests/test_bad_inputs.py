"""Bad tensors and arguments become exceptions that name the problem."""

import numpy as np
import pytest

import kvferry
from conftest import BT, SHAPE, paged, tokens


@pytest.fixture
def node(metaserver):
    with kvferry.Node(metaserver.address, pool_bytes=16 << 20) as n:
        yield n


def test_wrong_dtype(node, ns):
    k, v = paged()
    with pytest.raises(kvferry.BufferError, match="dtype float32, expected bfloat16") as e:
        node.register_kv_cache(ns, k, v, dtype="bfloat16")
    assert e.value.code == "dtype"
    v[1] = v[1].astype(np.float16)
    with pytest.raises(kvferry.BufferError, match="V of layer 1 has dtype float16"):
        node.register_kv_cache(ns, k, v)


def test_non_contiguous_block(node, ns):
    k, v = paged()
    big = np.zeros((SHAPE[0], BT, 2, 32), np.float32)
    k[0] = big[..., ::2]  # every other element: a block is not one range
    with pytest.raises(kvferry.BufferError, match="not contiguous inside a block") as e:
        node.register_kv_cache(ns, k, v)
    assert e.value.code == "not_contiguous"


def test_strided_blocks_are_fine(node, ns):
    # Blocks may sit apart (e.g. a view of every other block), each one contiguous.
    wide = [np.zeros((2 * SHAPE[0],) + SHAPE[1:], np.float32) for _ in range(4)]
    k, v = [w[::2] for w in wide[:2]], [w[::2] for w in wide[2:]]
    info = node.register_kv_cache(ns, k, v)
    assert info.block_stride == 2 * info.bytes_per_block


def test_shape_mismatch_between_layers(node, ns):
    k, v = paged()
    v[0] = np.zeros((SHAPE[0] - 1,) + SHAPE[1:], np.float32)
    with pytest.raises(kvferry.LayoutError, match="V of layer 0 has shape"):
        node.register_kv_cache(ns, k, v)


def test_not_a_tensor(node, ns):
    with pytest.raises(kvferry.BufferError, match="exposes no memory"):
        node.register_kv_cache(ns, [object()], [object()])


def test_read_only_memory(node, ns):
    k, v = paged()
    k[0].setflags(write=False)
    with pytest.raises(kvferry.BufferError, match="read-only"):
        node.register_kv_cache(ns, k, v)


class FakeCudaTensor:
    """Looks like a CUDA array to kvferry (no CUDA needed)."""

    def __init__(self, shape, ptr=0x7F0000000000):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": "<f4", "data": (ptr, False), "version": 3, "strides": None}


def test_tensor_on_another_device(node, ns):
    with pytest.raises(kvferry.BufferError, match="CUDA tensor but this node's backend is 'host'") as e:
        node.register_kv_cache(ns, [FakeCudaTensor(SHAPE)], [FakeCudaTensor(SHAPE)])
    assert e.value.code == "device"


def test_block_index_out_of_range(node, ns):
    k, v = paged()
    info = node.register_kv_cache(ns, k, v)
    hs = kvferry.block_hashes(ns, tokens(BT), BT)
    with pytest.raises(kvferry.BlockIndexError, match=f"has {info.num_blocks} blocks") as e:
        node.save(ns, hs, [info.num_blocks])
    assert e.value.code == "engine_block_index"


def test_unknown_namespace(node, ns):
    hs = kvferry.block_hashes(ns, tokens(BT), BT)
    with pytest.raises(kvferry.UnknownNamespaceError, match="register_kv_cache first"):
        node.save(ns, hs, [0])
    with pytest.raises(kvferry.UnknownNamespaceError):
        node.load(ns, hs, [0])


def test_hash_and_index_counts_must_match(node, ns):
    k, v = paged()
    node.register_kv_cache(ns, k, v)
    hs = kvferry.block_hashes(ns, tokens(2 * BT), BT)
    with pytest.raises(kvferry.ConfigError, match="2 hashes but 1 block indices"):
        node.save(ns, hs, [0])


def test_empty_hash_is_rejected(node, ns):
    k, v = paged()
    node.register_kv_cache(ns, k, v)
    with pytest.raises(kvferry.ConfigError) as e:
        node.save(ns, [b""], [0])
    assert e.value.code == "id_hash_length"


def test_different_layout_for_a_namespace(node, ns):
    k, v = paged()
    node.register_kv_cache(ns, k, v)
    k2, v2 = paged(shape=(4,) + SHAPE[1:])
    with pytest.raises(kvferry.LayoutError, match="already has a different layout"):
        node.register_kv_cache(ns, k2, v2)
    # The same tensors again are accepted.
    node.register_kv_cache(ns, k, v)


class FakeHostArray:
    def __init__(self, shape, ptr):
        self.__array_interface__ = {"shape": shape, "typestr": "<f4", "data": (ptr, False), "version": 3}


def test_freed_tensor_with_null_pointer(node, ns):
    with pytest.raises(kvferry.BufferError, match="null data pointer") as e:
        node.register_kv_cache(ns, [FakeHostArray(SHAPE, 0)])
    assert e.value.code == "null_pointer"


def test_buffer_smaller_than_the_layout(node):
    # The engine checks every layout against its buffers' registered sizes
    # (a one-layer layout under a namespace of the caller's own).
    k = np.zeros(SHAPE, np.float32)
    bpb = k[0].nbytes
    buf = node._node.register_buffer(k.ctypes.data, k.nbytes - 1)
    with pytest.raises(kvferry.LayoutError, match="large enough") as e:
        node._node.register_layout("raw/one-layer", [(buf, 0, None, 0, SHAPE[0], bpb, bpb)])
    assert e.value.code.startswith("layout_")


def test_namespace_naming_other_layer_count(node, ns):
    # `ns` names LAYERS layers; one layer is refused before anything registers.
    k, v = paged()
    with pytest.raises(kvferry.LayoutError, match="names 2 layers, the layout has 1") as e:
        node.register_kv_cache(ns, k[:1], v[:1])
    assert e.value.code == "engine_namespace_mismatch"
    node.register_kv_cache(ns, k, v)
