"""A FASTA file is read as protein records whatever its line ends, or refused on one line naming
what it is instead: RNA, DNA, FASTQ, UTF-16 or UTF-32 text, a corrupt gzip, alignment gaps, a
header without a sequence, a folder, or too little data to train on."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest
from refused_on_one_line import refused

from moe_tutorial.train import data

PROTEIN = b">a\nMKVLAAGLLLAAGKKEELWRRPQ\n>b\nMSTNPKPQRKTKRNTNRRPQDVKF\n"


def _fasta(tmp_path, raw: bytes, name: str = "x.fa") -> Path:
    path = tmp_path / name
    path.write_bytes(raw)
    return path


def test_old_mac_line_ends_read_as_records(tmp_path):
    path = _fasta(tmp_path, b">a\rMKVL\rAST\r>b\rWWY\r")
    assert data.load_sequences(path) == ["MKVLAST", "WWY"]


def test_mixed_line_ends_read_as_records(tmp_path):
    path = _fasta(tmp_path, b">a\r\nMKV\n>b\rLLA\r\n")
    assert data.load_sequences(path) == ["MKV", "LLA"]


def test_windows_line_ends_and_a_stop_codon_read_as_protein(tmp_path):
    path = _fasta(tmp_path, b">a\r\nMKVLAAG\r\nLLLAAG*\r\n")
    assert data.load_sequences(path) == ["MKVLAAGLLLAAG"]


def test_a_header_without_sequence_names_its_line_under_cr_line_ends(tmp_path):
    path = _fasta(tmp_path, b">a\rMKV\r>b\r>c\rLL\r")
    with pytest.raises(data.FastaFormatError, match=r"line 3: header '>b' has no sequence"):
        data.load_sequences(path)


def test_an_rna_file_is_refused_as_rna(tmp_path):
    path = _fasta(tmp_path, b">r\nAUGGCUACGUAGCUAGCUAGGCAUCG\n")
    with pytest.raises(data.FastaFormatError, match="looks like RNA.*translate it"):
        data.load_sequences(path)


def test_a_lower_case_dna_file_is_refused(tmp_path):
    path = _fasta(tmp_path, b">d\nacgtacgtnnacgtagctagctagc\n>e\nacgtagcatcg\n")
    with pytest.raises(data.FastaFormatError, match="looks like DNA"):
        data.load_sequences(path)


def test_a_glycine_alanine_rich_protein_is_still_protein(tmp_path):
    path = _fasta(tmp_path, b">collagen\nGPPGAPGPAGAPGPPGAPGPAGAPGKDG\n")
    assert data.load_sequences(path) == ["GPPGAPGPAGAPGPPGAPGPAGAPGKDG"]


def test_a_few_residues_are_too_few_to_call_nucleotides(tmp_path):
    assert data.load_sequences(_fasta(tmp_path, b">p\nACGT\n")) == ["ACGT"]


@pytest.mark.parametrize("encoding, named", [
    ("utf-16", "UTF-16"), ("utf-16-le", "UTF-16"), ("utf-16-be", "UTF-16"),
    ("utf-32", "UTF-32"), ("utf-32-le", "UTF-32"), ("utf-32-be", "UTF-32")])
def test_a_wide_fasta_is_named_by_its_encoding(tmp_path, encoding, named):
    """With or without a byte-order mark; UTF-32LE's mark begins with UTF-16LE's."""
    path = _fasta(tmp_path, PROTEIN.decode().encode(encoding))
    refused(lambda: data.load_sequences(path), data.FastaFormatError, named, "UTF-8")
    with pytest.raises(data.FastaFormatError) as exc:
        data.load_sequences(path)
    assert f"-f {named} -t UTF-8" in str(exc.value)


def test_a_fastq_file_is_named_as_not_fasta(tmp_path):
    path = _fasta(tmp_path, b"@r1\nMKVLAAG\n+\nIIIIIII\n", "x.fq")
    refused(lambda: data.load_sequences(path), data.FastaFormatError, "line 1", "'>'")


def test_alignment_gaps_are_named_as_the_residue_and_its_record(tmp_path):
    path = _fasta(tmp_path, b">a\nMKV-LAAGLL\n")
    refused(lambda: data.load_sequences(path), data.FastaFormatError, "'-'", "'>a'", "line 1")


def test_a_folder_given_as_the_fasta_file_is_one_line(tmp_path):
    refused(lambda: data.load_sequences(tmp_path), FileNotFoundError, str(tmp_path))


def test_a_truncated_gzip_fasta_is_named_as_corrupt(tmp_path):
    raw = gzip.compress(PROTEIN * 50)
    path = _fasta(tmp_path, raw[: len(raw) // 2], "x.fa.gz")
    refused(lambda: data.load_sequences(path), data.FastaFormatError, "corrupt gzip")


def test_on_invalid_takes_only_its_two_values():
    refused(lambda: data.load_sequences(on_invalid="ignore"), ValueError, "'raise' or 'skip'")


def test_a_single_sequence_is_too_few_to_split_and_says_so(tmp_path):
    path = _fasta(tmp_path, b">a\nMKVLAAGLLLAAGKKEEL\n")
    refused(lambda: data.load_protein_data(8, path=path), ValueError, "1 sequences",
            "validation")


def test_a_window_longer_than_the_data_is_one_line(tmp_path):
    path = _fasta(tmp_path, PROTEIN * 30)
    refused(lambda: data.load_protein_data(10_000, path=path), ValueError, "seq_len + 1")
