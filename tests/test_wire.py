"""Model-free: the native API is one table (kvbaton.wire.OPERATIONS) for both ends.

The HTTP client builds its bodies and reads its answers from the rows; the server registers one
route per row with the same request and answer models, and lets no operator that names handles or
agents run without a policy that keeps tenants apart.
"""

from __future__ import annotations

import inspect
import math
from types import SimpleNamespace

import pytest
from fastapi import FastAPI
from fastapi.routing import APIRoute
from kvbaton import wire
from kvbaton.errors import InvalidRequest
from kvbaton.handle import Handle, LineageStep, Op, Placement, Positions
from kvbaton.ops import OPERATORS, KVOps
from kvbaton.types import AgentInfo, ChatMessage, SamplingParams

pytestmark = pytest.mark.unit

HANDLE = Handle(id="a" * 32, model="m", model_fingerprint="0", tokenizer_fingerprint="0", num_tokens=2,
                positions=Positions(rope_type="default", rope_theta=1.0),
                lineage=(LineageStep(op=Op.MATERIALIZE, token_ids=(1, 2)),), placement=Placement(device="cpu"))


def test_every_operator_has_one_row_and_streams_share_their_twins_route():
    assert set(wire.OPERATIONS) == OPERATORS
    for name, row in wire.OPERATIONS.items():
        assert row.name == name and row.path.startswith("/v1/")
        if row.stream:
            twin = wire.OPERATIONS[name.removesuffix("_stream")]
            assert (twin.method, twin.path, twin.request, twin.stream) == (row.method, row.path, row.request, False)


@pytest.mark.parametrize("name", sorted(n for n, r in wire.OPERATIONS.items() if r.request is not None))
def test_a_request_model_takes_its_operators_parameters_unless_it_says_how(name):
    row = wire.OPERATIONS[name]
    assert row.request is not None
    if "of" in vars(row.request):  # its own mapping (compose's prefix, hints' STE map...)
        return
    params = set(inspect.signature(getattr(KVOps, name)).parameters) - {"self"}
    fields = set(row.request.model_fields)
    if issubclass(row.request, wire.Generation):  # its sampling argument is flat in the body
        fields, params = fields - set(wire.Sampling.model_fields), params - {"sampling"}
    assert fields == params


def test_bodies_are_the_validated_request_models():
    ops = wire.OPERATIONS
    assert ops["materialize"].body((1, 2, 3), agent="a") == {"context": [1, 2, 3], "agent": "a"}
    assert ops["fork"].body(HANDLE) == {"handle": HANDLE.model_dump(mode="json"), "k": 2}
    assert ops["release"].body("b" * 32) == {"handles": ["b" * 32]}
    assert ops["events"].body(5) == {"since": 5} and ops["stats"].body() is None
    assert ops["hints"].body({"a": 1, "b": math.inf}, running=["c"]) == {"steps": {"a": 1.0, "c": 0.0}}
    composed = ops["compose"].body(HANDLE, [HANDLE.segment(0, 1, slot="s")], "then")
    assert composed["prefix_handle"]["id"] == HANDLE.id and "prefix" not in composed
    assert composed["segments"] == [{"handle": HANDLE.model_dump(mode="json"), "start": 0, "end": 1, "slot": "s"}]
    body = ops["generate_stream"].body([ChatMessage(role="user", content="hi")], sampling=SamplingParams(max_tokens=3))
    assert body["messages"] == [{"role": "user", "content": "hi"}] and body["max_tokens"] == 3 and body["stream"]


@pytest.mark.parametrize(("call", "param"), [
    (lambda: wire.OPERATIONS["materialize"].body("x", agent="a" * 201), "agent"),
    (lambda: wire.OPERATIONS["complete"].body("x", reuse="sometimes"), "reuse"),
    (lambda: wire.OPERATIONS["fork"].body(HANDLE, k=True), "k"),
    (lambda: wire.OPERATIONS["generate"].body("not a list"), "messages"),
    (lambda: wire.OPERATIONS["materialize"].body(b"bytes"), None),
    (lambda: wire.OPERATIONS["events"].body(-1), None),
])
def test_a_body_the_model_refuses_raises_before_anything_is_sent(call, param):
    with pytest.raises(InvalidRequest) as err:
        call()
    assert err.value.param == param


def test_a_call_the_operator_refuses_is_a_type_error():
    with pytest.raises(TypeError):
        wire.OPERATIONS["tokenize"].body("a", "b")


def test_answers_are_read_as_the_operator_returns_them():
    ops = wire.OPERATIONS
    assert ops["tokenize"].read({"token_ids": [1, 2]}) == [1, 2]
    assert ops["release"].read({"released": 2}) is None
    assert ops["register_agent"].read({"name": "w", "fixed_tokens": 3}) == AgentInfo(name="w", fixed_tokens=3)
    assert ops["materialize"].read(HANDLE.model_dump(mode="json")) == HANDLE


def test_the_server_registers_its_native_routes_from_the_same_rows():
    from kvbaton.backend.server.native import add_native_routes

    app = FastAPI()
    add_native_routes(app, SimpleNamespace(engine=None))  # type: ignore[arg-type]  # registering calls nothing
    routes = {(method, route.path): route for route in app.routes if isinstance(route, APIRoute)
              for method in route.methods}
    for row in wire.OPERATIONS.values():  # a streaming row is answered by its twin's route
        route = routes[(row.method, row.path)]
        assert route.name == row.name.removesuffix("_stream") and route.response_model is row.answer
        if row.method == "POST":
            assert route.body_field is not None and route.body_field.field_info.annotation is row.request
        else:  # a GET's request model is its query
            assert route.body_field is None
            assert [p.field_info.annotation for p in route.dependant.query_params] == ([] if row.request is None
                                                                                       else [row.request])
    extras = set(routes) - {(row.method, row.path) for row in wire.OPERATIONS.values()}
    assert extras == {("POST", "/v1/kv/release_all"), ("GET", "/v1/kv/events/stream")}  # no operators


def test_an_operator_naming_handles_or_agents_gets_no_route_without_a_policy():
    from kvbaton.backend.server.native import _generic

    _generic(wire.Operation("tokenize", "POST", "/v1/kv/tokenize", wire.TokenizeRequest, wire.TokenIds))
    for row in (wire.Operation("x", "POST", "/v1/kv/x", wire.ForkRequest, wire.ReleaseResponse),
                wire.Operation("x", "POST", "/v1/kv/x", wire.MaterializeRequest, wire.TokenIds),
                wire.Operation("x", "POST", "/v1/kv/x", wire.TokenizeRequest, Handle)):
        with pytest.raises(TypeError, match="policy"):
            _generic(row)
