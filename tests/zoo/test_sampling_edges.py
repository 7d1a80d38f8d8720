"""``zoo.generate.sample`` at the edges of its options: a temperature close to 0 draws the greedy token (it once
overflowed every logit to +-inf, whose softmax is NaN, and ``multinomial`` raised); ``top_k`` and ``top_p`` draw
only from the tokens they keep, against a support computed here from the probabilities."""
import torch

from zoo.generate import sample


def test_a_tiny_positive_temperature_is_greedy():
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    for _ in range(5):
        logits = 40 * torch.randn(50)
        for temperature in (1e-307, 1e-310, 5e-324):
            assert sample(logits, temperature, generator=g) == int(logits.argmax())
            assert sample(logits, temperature, top_k=3, top_p=0.5, generator=g) == int(logits.argmax())


def test_top_k_and_top_p_draw_only_from_the_tokens_they_keep():
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    logits = torch.randn(12)
    logits[3] = float("-inf")
    order = logits.argsort(descending=True).tolist()
    probs = torch.softmax(logits.double() / 0.7, -1)[order]
    nucleus = int((probs.cumsum(0) < 0.6).sum()) + 1          # the smallest prefix reaching 0.6
    for kwargs, support in (({"top_k": 1}, order[:1]), ({"top_k": 4}, order[:4]), ({"top_k": 12}, order[:11]),
                            ({"top_p": 1e-9}, order[:1]), ({"top_p": 0.6}, order[:nucleus])):
        drawn = {sample(logits, 0.7, generator=g, **kwargs) for _ in range(200)}
        assert drawn <= set(support), f"{kwargs}: drew {sorted(drawn - set(support))} outside {support}"
