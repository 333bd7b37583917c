"""Tensor paths inside module outputs (``capture.iter_output_tensors``)."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, namedtuple
from typing import Any, NamedTuple

import torch

from torchinstruments.capture import MAX_OUTPUT_DEPTH, iter_output_tensors


def paths(output: object, prefix: str = "output") -> list[str]:
    return [path for path, _ in iter_output_tensors(output, prefix)]


def leaves(output: object) -> list[tuple[str, object]]:
    return list(iter_output_tensors(output))


T = torch.zeros(2)
U = torch.ones(3)


class ModelOutput(OrderedDict):
    """Attribute-style mapping, like Hugging Face ``transformers.utils.ModelOutput``."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError as error:
            raise AttributeError(name) from error


class Pair(NamedTuple):
    logits: torch.Tensor
    aux: object


@dataclasses.dataclass
class Result:
    hidden: torch.Tensor
    loss: torch.Tensor | None = None
    note: str = "x"


def test_single_tensor():
    assert leaves(T) == [("output", T)]


def test_custom_prefix():
    assert paths((T, U), prefix="out") == ["out[0]", "out[1]"]


def test_tuple_and_list():
    assert paths((T, U)) == ["output[0]", "output[1]"]
    assert paths([T, U, T]) == ["output[0]", "output[1]", "output[2]"]
    result = leaves((T, U))
    assert result[0][1] is T and result[1][1] is U


def test_dict_uses_subscript_with_repr_keys():
    assert paths({"logits": T, "hidden": U}) == ["output['logits']", "output['hidden']"]
    assert paths({0: T, "a b": U}) == ["output[0]", "output['a b']"]


def test_ordered_dict_uses_subscript():
    assert paths(OrderedDict([("b", T), ("a", U)])) == ["output['b']", "output['a']"]


def test_namedtuple_uses_attributes():
    assert paths(Pair(T, U)) == ["output.logits", "output.aux"]
    Legacy = namedtuple("Legacy", ["x", "y"])
    assert paths(Legacy(T, U)) == ["output.x", "output.y"]


def test_dataclass_uses_attributes_and_skips_none_and_non_tensors():
    assert paths(Result(hidden=T)) == ["output.hidden"]
    assert paths(Result(hidden=T, loss=U)) == ["output.hidden", "output.loss"]


def test_dataclass_type_is_not_walked():
    assert paths(Result) == []


def test_model_output_like_mapping_uses_attributes():
    output = ModelOutput(last_hidden_state=T, attentions=(U, U), logits=None)
    assert paths(output) == [
        "output.last_hidden_state",
        "output.attentions[0]",
        "output.attentions[1]",
    ]
    # Keys that are not identifiers fall back to the subscript form.
    output = ModelOutput([("not an identifier", T), ("ok", U)])
    assert paths(output) == ["output['not an identifier']", "output.ok"]


def test_none_and_non_tensor_leaves_are_skipped():
    assert paths(None) == []
    assert paths((None, T, 3, 2.5, "text", b"raw", None)) == ["output[1]"]
    assert paths({"a": None, "b": [None, U]}) == ["output['b'][1]"]


def test_tensor_leaves_of_any_dtype_are_yielded():
    ints = torch.arange(3)
    flags = torch.ones(2, dtype=torch.bool)
    empty = torch.zeros(0)
    assert leaves((ints, flags, empty)) == [
        ("output[0]", ints),
        ("output[1]", flags),
        ("output[2]", empty),
    ]


def test_nested_containers():
    output = (
        T,
        {"past": [(U, T), (T, U)], "extra": Pair(logits=U, aux={"k": T})},
        ModelOutput(hidden_states=[T]),
    )
    assert paths(output) == [
        "output[0]",
        "output[1]['past'][0][0]",
        "output[1]['past'][0][1]",
        "output[1]['past'][1][0]",
        "output[1]['past'][1][1]",
        "output[1]['extra'].logits",
        "output[1]['extra'].aux['k']",
        "output[2].hidden_states[0]",
    ]


def test_same_tensor_twice_yields_two_paths():
    assert paths((T, T)) == ["output[0]", "output[1]"]


def test_depth_bound():
    assert MAX_OUTPUT_DEPTH == 6

    def nest(levels: int) -> object:
        node: object = T
        for _ in range(levels):
            node = [node]
        return node

    # A tensor inside MAX_OUTPUT_DEPTH nested containers is found ...
    assert paths(nest(MAX_OUTPUT_DEPTH)) == ["output" + "[0]" * MAX_OUTPUT_DEPTH]
    # ... one level deeper it is not.
    assert paths(nest(MAX_OUTPUT_DEPTH + 1)) == []
    # Only the branch that is too deep is cut.
    assert paths((T, nest(MAX_OUTPUT_DEPTH))) == ["output[0]"]


def test_unsupported_containers_are_skipped():
    assert paths({T}) == []  # sets have no stable path
    assert paths(iter([T])) == []
    assert paths(object()) == []


def test_parameter_and_tensor_subclass_are_leaves():
    parameter = torch.nn.Parameter(torch.zeros(2))
    assert leaves({"w": parameter}) == [("output['w']", parameter)]
