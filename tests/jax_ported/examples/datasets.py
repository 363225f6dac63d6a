"""Synthetic stand-in for jax's examples/datasets.py (which downloads MNIST): the same function,
shapes and encodings (images flattened to 784 floats in [0, 1], one-hot labels of 10 classes),
with few examples whose labels follow from the pixels, so that training has something to learn."""
import numpy as np

NUM_TRAIN, NUM_TEST = 256, 128


def _one_hot(x, k, dtype=np.float32):
    return np.array(x[:, None] == np.arange(k), dtype)


def mnist(permute_train=False):
    rng = np.random.RandomState(0)
    images = rng.rand(NUM_TRAIN + NUM_TEST, 784).astype(np.float32)
    labels = (images @ rng.randn(784, 10)).argmax(1)
    train_images, test_images = images[:NUM_TRAIN], images[NUM_TRAIN:]
    train_labels, test_labels = _one_hot(labels[:NUM_TRAIN], 10), _one_hot(labels[NUM_TRAIN:], 10)
    if permute_train:
        perm = rng.permutation(NUM_TRAIN)
        train_images, train_labels = train_images[perm], train_labels[perm]
    return train_images, train_labels, test_images, test_labels
