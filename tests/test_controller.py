"""The speculation controller keeps throughput at the better of speculating and not, per batch size."""

from manager_svc.controller import SpeculationController


def run(controller: SpeculationController, batch_size: int, rate: dict[bool, float], iterations: int) -> float:
    """Feed the controller iterations whose output rate is rate[speculating]; the share of
    iterations it speculated in."""
    speculated = 0
    for _ in range(iterations):
        on = controller.speculate(batch_size)
        speculated += on
        controller.record(batch_size, on, tokens=int(rate[on] * 0.01), seconds=0.01)
    return speculated / iterations


def test_it_speculates_where_that_is_faster_and_not_where_it_is_slower():
    c = SpeculationController(explore=16)
    assert run(c, 1, {True: 300.0, False: 100.0}, 320) >= 1 - 1 / 16 - 0.01  # small batch: trees pay
    assert run(c, 16, {True: 200.0, False: 500.0}, 320) <= 1 / 16 + 0.01  # large batch: they cost
    assert run(c, 2, {True: 300.0, False: 100.0}, 10) > 0.5  # buckets are independent


def test_it_follows_a_change_of_the_better_choice_by_exploring():
    c = SpeculationController(explore=8, smoothing=0.5)
    assert run(c, 4, {True: 400.0, False: 100.0}, 200) > 0.8
    assert run(c, 4, {True: 50.0, False: 100.0}, 200) < 0.2  # e.g. the SSMs stopped predicting well
