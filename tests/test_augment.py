"""Positive-view augmentations: their names and rates (fastcl.augment), and the trainer's
--augment. What each changes, and its exact replay by the cached losses, is tested on the
sentence-transformers wrapper (tests/test_st_augment.py)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

from fastcl import augment, common
from fastcl.trainer import run as train
from test_train import base_args, step_records, tiny  # noqa: F401  (tiny: the fixture)

pytestmark = pytest.mark.usefixtures("one_thread", "outside")  # trainer tests: nothing written outside tmp_path

def test_parse_names_rates_and_defaults():
    assert augment.parse("token-cutoff") == augment.Augmentation("token_cutoff", common.AUGMENT_RATES["token_cutoff"])
    assert augment.parse("word_deletion:0.3").spec == "word_deletion:0.3"
    assert augment.parse(None) is None
    for bad, message in (("crop", "unknown augmentation 'crop'"), ("token_cutoff:x", "not a number"),
                         ("span_cutoff:0", r"must be in \(0, 1\]"), ("feature_cutoff:1.5", r"\(0, 1\]")):
        with pytest.raises(ValueError, match=message):
            augment.parse(bad)


# ---------------------------------------------------------------------------------------
# The trainer

@pytest.mark.parametrize("spec", ["token-cutoff", "word_deletion:0.2"])
def test_trainer_two_steps_with_augment(tiny, tmp_path, spec):  # noqa: F811
    out = tmp_path / "out"
    assert train.main(base_args(tiny, out, "simcse", steps=2, augment=spec, mini_batch_size=3)) == 0
    assert len(step_records(out)) == 2
    canonical = augment.parse(spec).spec
    assert f"augment: {canonical}" in (out / "fastcl_config.yaml").read_text()


def test_trainer_refuses_augment_where_it_does_not_apply(tiny, tmp_path, capsys):  # noqa: F811
    for method, spec, message in (("simcse-sup", "token_cutoff", "--augment applies to the unsupervised"),
                                  ("simcse", "crop", "--augment: unknown augmentation 'crop'")):
        with pytest.raises(SystemExit) as err:
            train.main(base_args(tiny, tmp_path / "o", method, augment=spec))
        assert err.value.code == 2 and message in capsys.readouterr().err
