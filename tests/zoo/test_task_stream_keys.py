"""The data streams of one recipe seed, in the bits torch's CPU generator reads: every ``(split, length)`` of a
run draws its own numbers, so training at one length never replays the test set of another."""
import torch

from mixers.options import build_options
from zoo.tasks import TASKS
from zoo.tasks.base import SPLIT_OFFSET, stream_seed

KEY = (1 << 32) - 1


def make(name, **options):
    cls = TASKS.get(name)
    return cls(build_options(cls.Options, options))


def test_the_generator_reads_only_the_low_32_bits_of_a_seed():
    value = int(torch.randint(1 << 30, ()))
    a = torch.rand(4, generator=torch.Generator().manual_seed(value))
    b = torch.rand(4, generator=torch.Generator().manual_seed(value + (5 << 32)))
    assert torch.equal(a, b)


def test_one_seed_gives_every_split_and_length_its_own_generator_key():
    seeds = [0, 2, 94_489, (1 << 31) - 1, int(torch.randint(1 << 31, ()))]
    lengths = list(range(1, 30_000)) + [(1 << 22) - 1, 1 << 22]
    for seed in seeds:
        seen = {}
        for split in SPLIT_OFFSET:
            for seq_len in lengths:
                value = stream_seed(seed, split, seq_len)
                assert 0 <= value < 1 << 63
                key = value & KEY
                assert seen.setdefault(key, (split, seq_len)) == (split, seq_len), (seed, split, seq_len, seen[key])


def test_lengths_below_the_switch_keep_the_linear_seed():
    for _ in range(50):
        seed, seq_len = int(torch.randint(1 << 31, ())), int(torch.randint(1, 7919, ()))
        for split, offset in (("train", 1), ("test", 2)):
            assert stream_seed(seed, split, seq_len) == seed * 1_000_003 + offset * 7919 + seq_len


def test_training_at_a_long_length_never_replays_a_test_set():
    """Seed 2 trained at 9,988 tokens drew the numbers of its test set at 5,227 (the same MQAR contexts, parity
    bits whose prefixes are the test sequences)."""
    mqar = make("mqar", vocab_size=256, seq_len=64, num_kv_pairs=8)
    train, test = mqar.make("train", 2, seq_len=9988, num_examples=20), mqar.make("test", 2, seq_len=5227, num_examples=20)
    assert not torch.equal(train.inputs[:, :16], test.inputs[:, :16])
    parity = make("parity", seq_len=64)
    train, test = parity.make("train", 2, seq_len=9988, num_examples=4), parity.make("test", 2, seq_len=5227, num_examples=4)
    assert not torch.equal(train.inputs[:, :5227], test.inputs)
