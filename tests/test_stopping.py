from specd.stopping import StopChecker, StopRules


def push_all(checker: StopChecker, tokens) -> list[str]:
    out = []
    for t in tokens:
        out.append(checker.push(t))
        if checker.finish_reason:
            break
    return out


def chars(ids) -> str:
    return "".join(map(chr, ids))


def test_holds_back_a_possible_stop_prefix_then_releases_it():
    checker = StopChecker(StopRules(max_tokens=10, stop=("xyz",)), chars)
    deltas = push_all(checker, map(ord, "abxyq"))
    assert deltas == ["a", "b", "", "", "xyq"]
    assert checker.finish_reason is None


def test_stop_string_spanning_tokens_is_cut():
    checker = StopChecker(StopRules(max_tokens=10, stop=("xyz",)), chars)
    deltas = push_all(checker, map(ord, "abxyzc"))
    assert "".join(deltas) == "ab" and checker.finish_reason == "stop" and len(checker.token_ids) == 5


def test_incomplete_character_is_held_back():
    pieces = {1: "a", 2: "\ufffd", 3: "é"}

    def decode(ids):
        text = "".join(pieces[i] for i in ids)
        return text.replace("\ufffdé", "é")  # token 2 + 3 form one character

    checker = StopChecker(StopRules(max_tokens=3), decode)
    assert push_all(checker, [1, 2, 3]) == ["a", "", "é"]
    assert checker.finish_reason == "length"


def test_eos_is_kept_in_ids_and_ignore_eos_goes_on():
    checker = StopChecker(StopRules(max_tokens=5, eos_token_ids=frozenset({0})), chars)
    push_all(checker, [97, 0, 98])
    assert checker.token_ids == [97, 0] and checker.finish_reason == "stop"
    ignoring = StopChecker(StopRules(max_tokens=3, eos_token_ids=frozenset({0}), ignore_eos=True), chars)
    push_all(ignoring, [97, 0, 98])
    assert ignoring.token_ids == [97, 0, 98] and ignoring.finish_reason == "length"
