"""moe_tutorial.train.data: tokenizer, FASTA reader, shipped data set, split, packing, batches."""

from __future__ import annotations

import gzip
import hashlib
import time

import pytest
import torch

from moe_tutorial.moe.config import MoEConfig
from moe_tutorial.train.data import (
    BOS_ID,
    DEFAULT_FASTA,
    EOS_ID,
    PAD_ID,
    VOCAB_SIZE,
    FastaFormatError,
    FastaRecord,
    ProteinTokenizer,
    iterate_batches,
    load_protein_data,
    load_sequences,
    pack_sequences,
    read_fasta,
    train_val_split,
    unigram_cross_entropy,
)

CATH_SHA256 = "bfaceaf89739cb5fa15ed432c8555c31e0b6dc308557592307a78d224e25909e"


def write(tmp_path, text, name="x.fa"):
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def cath():
    start = time.perf_counter()
    sequences = load_sequences()
    return sequences, time.perf_counter() - start


# --- tokenizer -------------------------------------------------------------------------------


def test_vocabulary():
    tok = ProteinTokenizer()
    assert VOCAB_SIZE == tok.vocab_size == MoEConfig().vocab_size == 24  # the models embed it
    assert (PAD_ID, BOS_ID, EOS_ID) == (0, 1, 2)
    tokens = ("<pad>", "<bos>", "<eos>", "A", "Y", "X")
    assert [tok.token_to_id(t) for t in tokens] == [0, 1, 2, 3, 22, 23]
    assert tok.id_to_token(3) == "A" and tok.id_to_token(23) == "X"
    with pytest.raises(ValueError):
        tok.id_to_token(24)
    with pytest.raises(ValueError):
        tok.token_to_id("B")  # an alias, not a token


def test_encode_decode_round_trip():
    tok = ProteinTokenizer()
    seq = "ACDEFGHIKLMNPQRSTVWYX"
    ids = tok.encode(seq)
    assert ids == [BOS_ID, *range(3, 24), EOS_ID]
    assert tok.encode(seq, add_special_tokens=False) == ids[1:-1]
    assert tok.decode(ids) == seq
    assert tok.decode(torch.tensor(ids)) == seq
    assert tok.decode(ids, skip_special_tokens=False) == f"<bos>{seq}<eos>"


def test_aliases_and_lower_case():
    tok = ProteinTokenizer()
    assert tok.decode(tok.encode("BZJUO")) == "XXXCK"
    assert tok.encode("mkv") == tok.encode("MKV")
    assert tok.decode(tok.encode("bzjuox")) == "XXXCKX"


@pytest.mark.parametrize(
    "seq, char, position", [("ACD1EF", "1", 4), ("-AC", "-", 1), ("AC*D", "*", 3), ("ACD*", "*", 4)]
)
def test_invalid_character_message(seq, char, position):
    with pytest.raises(ValueError) as error:
        ProteinTokenizer().encode(seq)
    message = str(error.value)
    assert repr(char) in message and f"position {position}" in message
    assert "ACDEFGHIKLMNPQRSTVWY" in message  # says what is allowed


# --- FASTA -----------------------------------------------------------------------------------

FASTA = ">seq1 first\nMKVL\nAAG\n\n>seq2\nmk v\n>seq3\nACDE*\n"
EXPECTED = [
    FastaRecord("seq1 first", "MKVLAAG", 1),
    FastaRecord("seq2", "mkv", 5),
    FastaRecord("seq3", "ACDE", 7),
]


def test_fasta_plain_and_gzip_give_the_same_records(tmp_path):
    plain = write(tmp_path, FASTA)
    # A gzip file without the .gz suffix: the magic bytes decide.
    zipped = tmp_path / "x_gz.fa"
    zipped.write_bytes(gzip.compress(FASTA.encode()))
    assert list(read_fasta(plain)) == list(read_fasta(zipped)) == EXPECTED


def test_fasta_crlf_line_endings(tmp_path):
    path = write(tmp_path, "")
    path.write_bytes(FASTA.replace("\n", "\r\n").encode())
    assert list(read_fasta(path)) == EXPECTED


@pytest.mark.parametrize(
    "text, line, words",
    [
        ("MKV\n>a\nMKV\n", 1, "expected a '>' header line"),
        ("\n\nMKV\n", 3, "expected a '>' header line"),
        (">a\nMKV\n>b\n>c\nMKV\n", 3, "no sequence"),
        (">a\nMKV\n\n>b\n", 4, "no sequence"),
        (">a\n*\n", 1, "no sequence"),
        ("\n\n", None, "no FASTA records"),
    ],
)
def test_malformed_fasta_names_file_and_line(tmp_path, text, line, words):
    path = write(tmp_path, text)
    with pytest.raises(FastaFormatError) as error:
        list(read_fasta(path))
    message = str(error.value)
    assert str(path) in message and words in message
    if line is not None:
        assert f"line {line}:" in message


def test_empty_file(tmp_path):
    path = write(tmp_path, "")
    with pytest.raises(FastaFormatError, match="empty file"):
        load_sequences(path)


def test_binary_file(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b">a\nMKV\n\x89PNG\xff\xfe\x00\n")
    with pytest.raises(FastaFormatError, match=r"line 3: not UTF-8 text"):
        load_sequences(path)


def test_corrupt_gzip(tmp_path):
    path = tmp_path / "x.fa.gz"
    path.write_bytes(gzip.compress(FASTA.encode() * 100)[:60])  # truncated
    with pytest.raises(FastaFormatError, match=r"after line \d+: corrupt gzip"):
        load_sequences(path)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.fa"):
        load_sequences(tmp_path / "nope.fa")


def test_invalid_residue_raise_and_skip(tmp_path):
    path = write(tmp_path, ">a\nMKV\n>b\nMK1V\n>c\nAC\n>d\nA-C\n")
    with pytest.raises(FastaFormatError) as error:
        load_sequences(path)
    message = str(error.value)
    assert f"{path}, line 3:" in message and "'1'" in message and "ACDEFGHIKLMNPQRSTVWY" in message

    with pytest.warns(UserWarning, match=r"skipped 2 of 4 .*line 3") as record:
        assert load_sequences(path, on_invalid="skip") == ["MKV", "AC"]
    assert len(record) == 1
    with pytest.raises(ValueError, match="on_invalid"):
        load_sequences(path, on_invalid="ignore")


def test_min_length(tmp_path):
    path = write(tmp_path, ">a\nMKV\n>b\nAC\n")
    assert load_sequences(path, min_length=3) == ["MKV"]


# --- the shipped data set --------------------------------------------------------------------


def test_shipped_asset_is_the_cath_file():
    with gzip.open(DEFAULT_FASTA, "rb") as f:
        assert hashlib.sha256(f.read()).hexdigest() == CATH_SHA256


def test_shipped_data_set_loads(cath):
    sequences, seconds = cath
    print(f"loaded {len(sequences)} sequences in {seconds:.2f} s")
    assert seconds < 5
    assert len(sequences) == 21_090
    assert sequences[0].startswith("MVLSEGEWQLVLHVWAKVEAD")
    first = next(read_fasta(DEFAULT_FASTA))
    assert first.header.startswith("cath|4_1_0|102mA00") and first.line == 1


def test_unigram_baseline_on_real_data():
    data = load_protein_data(256)
    print(f"unigram baseline: {data.unigram_nats:.4f} nats/token")
    assert 2.8 < data.unigram_nats < 3.0
    assert data.num_sequences == 21_090 and data.source == DEFAULT_FASTA
    assert data.train.shape[1] == data.val.shape[1] == 257


def test_max_sequences(tmp_path):
    path = write(tmp_path, "".join(f">s{i}\n{'MKV' * (i % 9 + 3)}\n" for i in range(500)))
    data = load_protein_data(32, max_sequences=200, val_fraction=0.1, path=path)
    assert data.num_sequences == 200 and data.source == path
    again = load_protein_data(32, max_sequences=200, val_fraction=0.1, path=path)
    assert torch.equal(data.train, again.train) and torch.equal(data.val, again.val)
    other = load_protein_data(32, max_sequences=200, val_fraction=0.1, path=path, seed=1)
    assert not torch.equal(data.train[:5], other.train[:5])


# --- split, packing, batches -----------------------------------------------------------------

SEQUENCES = ["ACDEFGHIKLMNPQRSTVWY"[i % 20] * (i % 7 + 1) for i in range(100)]


def test_split_is_deterministic_and_disjoint():
    sequences = [f"M{'A' * i}" for i in range(100)]  # all distinct
    train, val = train_val_split(sequences, 0.1, seed=3)
    assert (train, val) == train_val_split(sequences, 0.1, seed=3)
    assert train_val_split(sequences, 0.1, seed=4) != (train, val)
    assert len(val) == 10 and len(train) == 90
    assert not set(train) & set(val) and sorted(train + val) == sorted(sequences)


@pytest.mark.parametrize("fraction, n", [(0.0, 10), (1.0, 10), (0.01, 10), (0.99, 10)])
def test_split_rejects_empty_sides(fraction, n):
    with pytest.raises(ValueError):
        train_val_split(["MKV"] * n, fraction)


def test_packing_covers_every_target_once():
    tok = ProteinTokenizer()
    stream = [t for s in SEQUENCES for t in tok.encode(s)]
    seq_len = 16
    packed = pack_sequences(SEQUENCES, seq_len)
    n = (len(stream) - 1) // seq_len
    assert packed.dtype == torch.long and packed.shape == (n, seq_len + 1)
    # Consecutive windows share one token ...
    assert torch.equal(packed[:-1, -1], packed[1:, 0])
    # ... so the first token plus all targets rebuild the stream, each token exactly once.
    rebuilt = torch.cat([packed[:1, 0], packed[:, 1:].flatten()])
    assert rebuilt.tolist() == stream[: n * seq_len + 1]


def test_packing_too_short():
    with pytest.raises(ValueError, match="fewer than one window"):
        pack_sequences(["MKV"], seq_len=5)  # 5 tokens, a window needs 6


def test_batches():
    packed = pack_sequences(SEQUENCES, 8)  # 72 windows
    n = packed.shape[0]
    batches = list(iterate_batches(packed, 10, epochs=2, seed=1))
    assert len(batches) == 2 * (n // 10)  # incomplete last batch dropped
    for inputs, labels in batches:
        assert inputs.shape == labels.shape == (10, 8) and inputs.dtype == torch.long
        assert torch.equal(inputs[:, 1:], labels[:, :-1])
    # Epochs are shuffled differently, reproducibly for a seed.
    first_epoch = torch.cat([x for x, _ in batches[: n // 10]])
    second_epoch = torch.cat([x for x, _ in batches[n // 10 :]])
    assert not torch.equal(first_epoch, second_epoch)
    again = list(iterate_batches(packed, 10, epochs=2, seed=1))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, again))
    assert not torch.equal(next(iterate_batches(packed, 10, seed=2))[0], batches[0][0])


def test_batches_resume_at_any_position():
    packed = pack_sequences(SEQUENCES, 8)  # 72 windows: 7 batches of 10 per epoch
    for shuffle in (True, False):
        whole = list(iterate_batches(packed, 10, shuffle=shuffle, epochs=3, seed=4))
        for start in (0, 3, 7, 9, 20):
            rest = list(iterate_batches(packed, 10, shuffle=shuffle, epochs=3, seed=4, start=start))
            assert len(rest) == len(whole) - start
            assert all(torch.equal(a[0], b[0]) for a, b in zip(rest, whole[start:]))
    with pytest.raises(ValueError, match="start=-1"):
        next(iterate_batches(packed, 10, start=-1))


def test_batches_in_order_and_forever():
    packed = pack_sequences(SEQUENCES, 8)
    inputs, labels = next(iterate_batches(packed, 4, shuffle=False))
    assert torch.equal(inputs, packed[:4, :-1]) and torch.equal(labels, packed[:4, 1:])
    forever = iterate_batches(packed, packed.shape[0])
    assert len([next(forever) for _ in range(5)]) == 5


def test_batch_size_larger_than_windows():
    packed = pack_sequences(SEQUENCES, 8)
    with pytest.raises(ValueError, match=rf"batch_size=1000 .*\({packed.shape[0]}\)"):
        next(iterate_batches(packed, 1000))


def test_unigram_cross_entropy_matches_hand_computation():
    train = torch.tensor([[1, 3, 3, 4]])  # targets 3, 3, 4
    val = torch.tensor([[1, 3, 4]])  # targets 3, 4
    total = 3 + VOCAB_SIZE  # add-one smoothing
    expected = -(torch.log(torch.tensor(3 / total)) + torch.log(torch.tensor(2 / total))) / 2
    assert unigram_cross_entropy(train, val) == pytest.approx(expected.item())
