"""The overload bench's arrival-order count: only waiters that waited side by side are compared, within a slack."""

from __future__ import annotations

from sluice.bench.overload import Request, out_of_order


def _waiter(sent_s: float, began_s: float) -> Request:
    return Request(sent_s, began_s, 200, "")


def test_waiters_served_in_arrival_order_have_no_inverted_pair() -> None:
    requests = [_waiter(sent, sent + 3.0) for sent in (0.0, 0.5, 1.0, 1.5)]
    assert out_of_order(requests, waited_past_s=2.0, slack_s=0.25) == (0, 6)


def test_a_later_waiter_served_first_is_one_inverted_pair() -> None:
    requests = [_waiter(0.0, 4.0), _waiter(1.0, 3.5)]
    assert out_of_order(requests, waited_past_s=2.0, slack_s=0.25) == (1, 1)


def test_within_the_slack_neither_arrival_nor_start_counts() -> None:
    sent_together = [_waiter(0.0, 4.0), _waiter(0.1, 3.5)]
    began_together = [_waiter(0.0, 3.6), _waiter(1.0, 3.5)]
    assert out_of_order(sent_together, waited_past_s=2.0, slack_s=0.25) == (0, 0)
    assert out_of_order(began_together, waited_past_s=2.0, slack_s=0.25) == (0, 1)


def test_requests_that_did_not_wait_a_slice_or_were_not_served_are_left_out() -> None:
    refused = Request(0.1, 5.0, 503, "router_unreachable")
    requests = [_waiter(0.0, 1.0), _waiter(0.5, 0.6), Request(0.2, None, 0, "ReadError"), refused, _waiter(0.3, 4.0)]
    assert out_of_order(requests, waited_past_s=2.0, slack_s=0.25) == (0, 0)


def test_a_request_sent_after_another_began_is_not_compared_with_it() -> None:
    requests = [_waiter(0.0, 2.5), _waiter(3.0, 5.5)]
    assert out_of_order(requests, waited_past_s=2.0, slack_s=0.25) == (0, 0)
