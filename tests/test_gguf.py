"""GGUF loading: both real models tensor by tensor, and clear errors for malformed files."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

import pyggml as pg
from pyggml.gguf import GGUFError, GGUFFile


@pytest.fixture(scope="module")
def loaded(smollm2_path, gemma3_path):
    return {name: pg.gguf.load(path) for name, path in (("smollm2", smollm2_path), ("gemma3", gemma3_path))}


@pytest.fixture(scope="module")
def gguf_readers(smollm2_path, gemma3_path):
    """The gguf package's own reader of each file, to check ours against."""
    return {"smollm2": gguf.GGUFReader(smollm2_path), "gemma3": gguf.GGUFReader(gemma3_path)}


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_metadata_matches_gguf_reader(loaded, gguf_readers, model):
    f, _ = loaded[model]
    reader = gguf_readers[model]
    keys = [k for k in reader.fields if not k.startswith("GGUF.")]
    assert sorted(keys) == sorted(f.metadata)
    for key in keys:
        want = reader.fields[key].contents()
        got = f.metadata[key]
        if isinstance(want, list) and want and isinstance(want[0], (int, float)) and not isinstance(want[0], bool):
            assert isinstance(got, np.ndarray), key  # numbers kept as one array, not a list
            assert np.array_equal(got, np.asarray(want, got.dtype)), key
        else:
            assert got == want, key


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_every_tensor_matches_gguf_reader(loaded, gguf_readers, model):
    f, tensors = loaded[model]
    reader = gguf_readers[model]
    assert len(tensors) == len(reader.tensors) > 100
    for rt in reader.tensors:
        t = tensors[rt.name]
        assert t.buffer is not None and t.type == pg.Type(int(rt.tensor_type))
        assert list(t.ne[: len(rt.shape)]) == [int(n) for n in rt.shape]
        raw = pg.tensor_get(t)
        ref = gguf.quants.dequantize(np.asarray(rt.data), rt.tensor_type).reshape(-1)
        ours = pg.quants.dequantize(raw.reshape(-1, t.row_size()), t.type).reshape(-1)
        assert np.array_equal(ours, ref), rt.name


def test_metadata(loaded):
    smol, _ = loaded["smollm2"]
    assert smol.architecture == "llama"
    assert smol.get("llama.block_count") == 30 and smol.get("llama.embedding_length") == 576
    assert smol.get("tokenizer.ggml.model") == "gpt2" and len(smol.get("tokenizer.ggml.tokens")) == 49152
    gem, tensors = loaded["gemma3"]
    assert gem.architecture == "gemma3" and gem.get("gemma3.attention.sliding_window") == 512
    assert {t.type for t in tensors.values()} >= {pg.Type.Q5_0, pg.Type.Q4_K, pg.Type.Q6_K, pg.Type.Q8_0, pg.Type.F32}


def _small_gguf(path):
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("llama.block_count", 1)
    w.add_tensor("a.weight", np.arange(64, dtype=np.float32).reshape(2, 32))
    q = pg.quants.quantize(np.ones((4, 64), np.float32), pg.Type.Q8_0)
    w.add_tensor("b.weight", q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_small_file_round_trip(tmp_path):
    f, tensors = pg.gguf.load(_small_gguf(tmp_path / "ok.gguf"))
    assert f.get("llama.block_count") == 1
    assert np.array_equal(pg.tensor_array(tensors["a.weight"])[0, 0], np.arange(64, dtype=np.float32).reshape(2, 32))
    expected = pg.quants.dequantize(pg.quants.quantize(np.ones((4, 64), np.float32), pg.Type.Q8_0), pg.Type.Q8_0)
    assert np.array_equal(pg.tensor_array(tensors["b.weight"])[0, 0], expected)


@pytest.mark.parametrize("mmap", [True, False])
def test_strided_slices_read_their_pieces_and_stay_inside_the_data(tmp_path, mmap):
    """A tensor split's rows of every matrix in a stack: pieces of equal size, a stride apart,
    read from the file's map or from the file; pieces past the tensor's data are refused."""
    f = GGUFFile(_small_gguf(tmp_path / "ok.gguf"))
    t = pg.Tensor(pg.Type.F32, (8, 2), name="a.weight")  # elements 8..15 of each of the 2 rows of 32
    buffers = f.load([t], pg.cpu_device().get_buffer_type(), mmap=mmap,
                     source_of=lambda _: ("a.weight", 8 * 4, 2 * 8 * 4, 2, 32 * 4))
    assert np.array_equal(pg.tensor_array(t)[0, 0], np.arange(64, dtype=np.float32).reshape(2, 32)[:, 8:16])
    for b in buffers:
        b.free()
    for bad in (("a.weight", 8 * 4, 2 * 8 * 4, 2, 60 * 4), ("a.weight", 0, 12, 0, 4), ("a.weight", 0, 10, 3, 4)):
        with pytest.raises(GGUFError, match="outside its data"):
            f.load([pg.Tensor(pg.Type.F32, (8, 2), name="a.weight")], pg.cpu_device().get_buffer_type(),
                   source_of=lambda _, bad=bad: bad)


def test_missing_file(tmp_path):
    with pytest.raises(GGUFError, match="no such file") as e:
        GGUFFile(tmp_path / "nope.gguf")
    assert "nope.gguf" in str(e.value)


def test_wrong_magic(tmp_path):
    p = tmp_path / "text.gguf"
    p.write_text("this is not a model, just some text\n")
    with pytest.raises(GGUFError, match="not a GGUF file"):
        GGUFFile(p)


def test_truncated_header_and_data(tmp_path):
    good = _small_gguf(tmp_path / "ok.gguf").read_bytes()
    for n, what in [(6, "truncated"), (100, "truncated or corrupt"), (len(good) - 40, "past the end|truncated")]:
        p = tmp_path / f"cut{n}.gguf"
        p.write_bytes(good[:n])
        with pytest.raises(GGUFError, match=what) as e:
            GGUFFile(p)
        assert str(p) in str(e.value)


def test_unknown_tensor_type(tmp_path):
    data = bytearray(_small_gguf(tmp_path / "ok.gguf").read_bytes())
    name = b"b.weight"
    at = data.index(name) + len(name)
    n_dims = int.from_bytes(data[at:at + 4], "little")
    type_at = at + 4 + 8 * n_dims
    assert int.from_bytes(data[type_at:type_at + 4], "little") == pg.Type.Q8_0
    data[type_at:type_at + 4] = (77).to_bytes(4, "little")
    p = tmp_path / "badtype.gguf"
    p.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match="type") as e:
        GGUFFile(p)
    assert "badtype.gguf" in str(e.value)


def test_offset_past_end(tmp_path):
    data = bytearray(_small_gguf(tmp_path / "ok.gguf").read_bytes())
    name = b"b.weight"
    at = data.index(name) + len(name)
    n_dims = int.from_bytes(data[at:at + 4], "little")
    off_at = at + 4 + 8 * n_dims + 4
    data[off_at:off_at + 8] = (1 << 40).to_bytes(8, "little")
    p = tmp_path / "badoffset.gguf"
    p.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match="past the end|truncated or corrupt"):
        GGUFFile(p)


def test_host_weights_stay_in_the_files_memory_map(smollm2_path):
    f, tensors = pg.gguf.load(smollm2_path)
    buffers = {id(t.buffer): t.buffer for t in tensors.values()}
    assert len(buffers) == 1  # one buffer: the whole file, no copy
    (buf,) = buffers.values()
    assert np.shares_memory(buf.data, f.map)
    t = tensors["blk.0.attn_q.weight"]
    assert t.offset == f.tensors["blk.0.attn_q.weight"].offset


def _strings_gguf(path, pieces):
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_array("tokenizer.ggml.tokens", pieces)
    w.add_uint32("llama.block_count", 1)
    w.add_tensor("a.weight", np.arange(32, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_string_arrays_and_their_corrupt_counts_and_lengths(tmp_path):
    """A vocabulary's strings read back as written (empty, multi-byte), and a count or a length
    the file cannot hold is an error saying so - never a list sized by the file's word."""
    pieces = ["<s>", "", "héllo", "▁the", "日本", "x" * 300]
    good = _strings_gguf(tmp_path / "ok.gguf", pieces).read_bytes()
    f = GGUFFile(tmp_path / "ok.gguf")
    assert list(f.get("tokenizer.ggml.tokens")) == pieces and f.get("llama.block_count") == 1
    count_at = good.index(b"tokenizer.ggml.tokens") + len(b"tokenizer.ggml.tokens") + 4 + 4  # value type, element type
    assert int.from_bytes(good[count_at:count_at + 8], "little") == len(pieces)
    first_at = count_at + 8  # the first string's length
    for name, at, value in [("count", count_at, 1 << 62), ("length", first_at, 1 << 40),
                            ("wrapping length", first_at, (1 << 64) - 4)]:
        bad = bytearray(good)
        bad[at:at + 8] = value.to_bytes(8, "little")
        p = tmp_path / f"bad {name}.gguf"
        p.write_bytes(bytes(bad))
        with pytest.raises(GGUFError, match="truncated or corrupt"):
            GGUFFile(p)
