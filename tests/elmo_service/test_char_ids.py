import numpy as np

from elmo_service.bilm.char_ids import batch_ids, bos_ids, eos_ids, sentence_ids, token_ids


def test_token_ids_follow_bilm_tf_scheme_shifted_by_one():
    ids = token_ids("ab", 50)
    # begin-of-word 258, bytes, end-of-word 259, padding 260; all +1
    assert ids[:4].tolist() == [259, ord("a") + 1, ord("b") + 1, 260]
    assert (ids[4:] == 261).all()
    assert ids.shape == (50,)


def test_multibyte_and_long_tokens_are_cut_at_48_bytes():
    ids = token_ids("é", 50)
    assert ids[1:3].tolist() == [0xC3 + 1, 0xA9 + 1]
    long = "x" * 100
    ids = token_ids(long, 50)
    assert (ids[1:49] == ord("x") + 1).all()
    assert ids[49] == 260  # end-of-word still present after the cut


def test_sentence_markers():
    assert bos_ids(50)[:4].tolist() == [259, 257, 260, 261]
    assert eos_ids(50)[:4].tolist() == [259, 258, 260, 261]
    s = sentence_ids(["a"], 50)
    assert s.shape == (3, 50)
    assert (s[0] == bos_ids(50)).all() and (s[2] == eos_ids(50)).all()


def test_batch_padding_rows_are_zero():
    ids, lengths = batch_ids([["a", "b", "c"], ["d"]], 50)
    assert ids.shape == (2, 5, 50)
    assert lengths.tolist() == [5, 3]
    assert (ids[1, 3:] == 0).all()
    assert (ids[1, :3] != 0).all()
    assert np.array_equal(ids[1, 1], token_ids("d", 50))
