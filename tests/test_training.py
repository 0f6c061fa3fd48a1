"""The pieces of the embedded model's training that are cheap to check: data, tokens, checkpoints."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from transformers import CLIPTokenizer

from tools import shapes
from tools.tiny_tokenizer import write_tokenizer
from tools.train import edge_weights, load_checkpoint, save_checkpoint, scene_rng


def test_a_seed_gives_the_same_scenes_in_every_process():
    a_images, a_captions = shapes.batch(scene_rng(0, 1, 7), 8)
    b_images, b_captions = shapes.batch(scene_rng(0, 1, 7), 8)
    assert a_captions == b_captions
    np.testing.assert_array_equal(a_images, b_images)
    assert shapes.batch(scene_rng(0, 1, 8), 8)[1] != a_captions
    assert a_images.shape == (8, shapes.SIDE, shapes.SIDE, 3) and -1.0 <= a_images.min() <= a_images.max() <= 1.0


@pytest.mark.parametrize(
    "args, expected",
    [
        (("red", "circle", "blue"), "a red circle on a blue background"),
        (("orange", "star", "white", "small"), "a small orange star on a white background"),
        (("white", "square", "orange", "large"), "a large white square on an orange background"),
    ],
)
def test_captions(args, expected):
    assert shapes.caption(*args) == expected


def test_every_caption_word_is_one_token(tmp_path):
    # "and" and "an" merge "a n" early; "orange" must still come out whole.
    write_tokenizer(tmp_path, shapes.WORDS)
    tokenizer = CLIPTokenizer.from_pretrained(str(tmp_path))
    assert [tokenizer.tokenize(w) for w in shapes.WORDS] == [[w + "</w>"] for w in shapes.WORDS]
    assert tokenizer.tokenize("an emerald rhombus")  # any other text still tokenizes, by bytes


def test_edges_get_the_extra_weight():
    image = np.full((1, 16, 16, 3), -1.0, np.float32)
    image[:, 4:12, 4:12] = 1.0
    weights = np.asarray(edge_weights(jnp.asarray(image), 4.0))[0, :, :, 0]
    assert weights[0, 0] == 1.0 and weights[8, 8] == 1.0  # flat colour, outside and inside
    assert weights[4, 8] == 5.0 and weights[2, 8] == 5.0  # on the edge and one pixel off


def test_a_checkpoint_restores_every_leaf(tmp_path):
    tree = {"params": {"w": jnp.arange(6.0).reshape(2, 3)}, "opt": (jnp.int32(5), [jnp.ones(4)])}
    save_checkpoint(tmp_path / "c.npz", tree, 42, 61.5)
    zeros = jax.tree.map(jnp.zeros_like, tree)
    restored, step, seconds = load_checkpoint(tmp_path / "c.npz", zeros)
    assert (step, seconds) == (42, 61.5)
    assert jax.tree.structure(restored) == jax.tree.structure(tree)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(tree), strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="other model or optimizer shapes"):
        load_checkpoint(tmp_path / "c.npz", {"params": {"w": jnp.zeros((3, 3))}, "opt": zeros["opt"]})
