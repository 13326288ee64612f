"""The Python twin of the CRD (`sluice render` and the operator: sluice_operator.spec.parse_endpoint) against the real
API server, differentially (marker `cluster`; tests/support/dev_cluster.py).

Hypothesis makes InferenceEndpoints: an example with one to three parts replaced by values drawn from the CRD's own
schema at that place (often of the wrong type, out of bounds, off pattern, unknown or missing; a null now and then)
or removed. Each is sent to the server (a dry-run create with strict field validation, as `kubectl apply` sends it)
and to the twin: both admit it or both refuse it, and a refusal names the same field (or the same CEL rule's
message). A spec that previews fine in `sluice render` or CI and is then refused by the cluster (the issue's
`cost.gpuHourUSD: "2.10"`) fails here; so does a twin stricter than the server.

One divergence is known and not generated: an integral float (`600.0`) on an integer field. The server admits it
where no CEL rule reads the field, and refuses it where one does ("expected int, got float64 evaluating rule"); the
twin refuses it everywhere (YAML's `600` is an int, so only a deliberate `600.0` meets this).
"""

from __future__ import annotations

import copy
import re
import ssl
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from dev_cluster import Cluster
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from operator_schemas import CRD_FILE, EXAMPLES, load_yaml
from test_cluster_api import _rule_messages

from sluice_operator.engine_flags import PASSTHROUGH_FLAGS
from sluice_operator.spec import SpecError, parse_endpoint

pytestmark = pytest.mark.cluster

SPECS_PER_RUN = 2000
CRD = load_yaml(CRD_FILE)
ROOT_SCHEMA = next(v for v in CRD["spec"]["versions"] if v["storage"])["schema"]["openAPIV3Schema"]
SPEC_SCHEMA = ROOT_SCHEMA["properties"]["spec"]
BASES = [load_yaml(p) for p in EXAMPLES]
NAMESPACES = sorted({b["metadata"].get("namespace", "default") for b in BASES})
MAX_DEPTH = 5  # below this, values are scalars: core/v1 types nest deeply, and the errors are found higher up


RULE_MESSAGES = _rule_messages(ROOT_SCHEMA)  # every CEL rule's message


# -- generation -------------------------------------------------------------------------------------------------
def _fractional(lo: float = -1e6, hi: float = 1e6) -> st.SearchStrategy[float]:
    return st.floats(lo, hi, allow_nan=False, allow_infinity=False).filter(lambda f: not f.is_integer())


SCALARS = st.one_of(
    st.booleans(), st.integers(-5, 5), st.integers(-(2**40), 2**40), _fractional(),
    st.text(max_size=8), st.sampled_from(["2.10", "1", "true", "0.5", "1Gi", "50%", "", "-1"]))
NOISE = st.one_of(st.none(), SCALARS, st.lists(SCALARS, max_size=2),
                  st.dictionaries(st.sampled_from(["a", "name", "type", "foo"]), SCALARS, max_size=2))


# engine.args: every flag, and values of each kind a flag takes, and near misses.
FLAGS = sorted(PASSTHROUGH_FLAGS) + ["model", "port", "api-key"]
INT_OR_STRINGS = ["1", "-2", "+3", "50%", "1Gi", "2.5", ".5", "1e3", "1E-2", "0.85", "abc", "100Mi", "true", "false",
                  "True", "", " 12", "1_000", "nan", "inf", "fast", "exact", "auto", "triton", "ngram", "info"]


def _string(schema: dict[str, Any]) -> st.SearchStrategy[str]:
    options = [st.text(max_size=12)]
    if "pattern" in schema:
        options.append(st.from_regex(schema["pattern"], fullmatch=True).filter(lambda s: len(s) <= 256))
    if "maxLength" in schema:
        n = schema["maxLength"]
        options.append(st.integers(max(0, n - 1), n + 1).map(lambda k: "a" * k))
    return st.one_of(options)


def _integer(schema: dict[str, Any]) -> st.SearchStrategy[int]:
    lo = schema.get("minimum", -10)
    hi = schema.get("maximum", lo + 100)
    return st.one_of(st.integers(lo - 1, hi + 1), st.sampled_from([lo, hi, lo - 1, hi + 1]))


def typed(schema: dict[str, Any], depth: int) -> st.SearchStrategy[Any]:
    """A value of the schema's shape: mostly of its type, bounds and enum give or take one."""
    if depth >= MAX_DEPTH:
        return SCALARS
    if "enum" in schema:
        return st.one_of(st.sampled_from(schema["enum"]), st.text(max_size=6))
    if schema.get("x-kubernetes-int-or-string"):
        return st.one_of(st.integers(-3, 2**31), st.sampled_from(INT_OR_STRINGS), _string(schema))
    kind = schema.get("type")
    if kind == "string":
        return _string(schema)
    if kind == "integer":
        return _integer(schema)
    if kind == "number":
        lo, hi = schema.get("minimum", -10), schema.get("maximum", 1000)
        return st.one_of(_fractional(lo - 1, hi + 1), st.integers(int(lo) - 1, int(hi) + 1))
    if kind == "boolean":
        return st.booleans()
    if kind == "array":
        items = schema.get("items", {})
        return st.lists(value(items, depth + 1), max_size=min(schema.get("maxItems", 3) + 1, 3))
    if kind == "object" and "properties" in schema:
        props = schema["properties"]
        required = [k for k in schema.get("required", []) if k in props]
        return st.fixed_dictionaries({k: value(props[k], depth + 1) for k in required},
                                     optional={k: value(v, depth + 1) for k, v in props.items() if k not in required})
    if kind == "object" and isinstance(schema.get("additionalProperties"), dict):
        keys = st.one_of(st.text(min_size=1, max_size=10), st.sampled_from(["a", "app", *FLAGS]), st.sampled_from(FLAGS))
        return st.dictionaries(keys, value(schema["additionalProperties"], depth + 1), max_size=3)
    return NOISE


def value(schema: dict[str, Any], depth: int) -> st.SearchStrategy[Any]:
    """Three times in four of the schema's shape, else anything (a wrong type, a null, a list for an object)."""
    shaped = typed(schema, depth)
    return st.one_of(shaped, shaped, shaped, NOISE)


@st.composite
def _edit(draw: st.DrawFn, doc: dict[str, Any]) -> None:
    """One change at a place the CRD describes: spec, or metadata.name."""
    if draw(st.integers(0, 39)) == 0:
        doc["spec"] = draw(NOISE)
        return
    if draw(st.integers(0, 19)) == 0:
        doc["metadata"]["name"] = draw(st.one_of(st.from_regex(r"[a-z][-a-z0-9]{0,45}", fullmatch=True),
                                                 st.text(max_size=10)))
        return
    parent, key, schema, depth = doc, "spec", SPEC_SCHEMA, 1
    while depth == 1 or draw(st.integers(0, 9)) >= 3:  # into spec, then further seven times in ten
        node = parent.get(key) if isinstance(parent, dict) else None
        if schema.get("type") == "object" and "properties" in schema:
            child = draw(st.sampled_from(sorted(schema["properties"])))
            sub = schema["properties"][child]
        elif schema.get("type") == "object" and isinstance(schema.get("additionalProperties"), dict):
            existing = sorted(node) if isinstance(node, dict) else []
            child = draw(st.sampled_from(existing) if existing else st.just("max-num-seqs"))
            sub = schema["additionalProperties"]
        elif schema.get("type") == "array" and isinstance(node, list) and node:
            parent, key, schema, depth = node, 0, schema.get("items", {}), depth + 1
            continue
        else:
            break
        if not isinstance(node, dict):
            node = parent[key] = {}
        parent, key, schema, depth = node, child, sub, depth + 1
    action = draw(st.sampled_from(["set", "set", "set", "delete", "unknown"]))
    if action == "delete" and isinstance(parent, dict):
        parent.pop(key, None)
    elif action == "unknown" and isinstance(parent.get(key) if isinstance(parent, dict) else parent[key], dict):
        target = parent[key]
        target[draw(st.sampled_from(["bogus", "nodeAfinity", "Replicas", "max_replicas"]))] = draw(SCALARS)
    else:
        parent[key] = draw(value(schema, depth))


@st.composite
def endpoints(draw: st.DrawFn) -> dict[str, Any]:
    doc = copy.deepcopy(draw(st.sampled_from(BASES)))
    for _ in range(draw(st.integers(1, 3))):
        draw(_edit(doc))
    return doc


# -- the two judges ---------------------------------------------------------------------------------------------
class Server:
    """Dry-run creates straight to the API server over HTTPS with the admin's client certificate: ~10 ms each,
    where a kubectl process costs ~150 ms."""

    def __init__(self, cluster: Cluster):
        pki = cluster.state / "pki"
        ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        ctx.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))
        self.http = httpx.Client(base_url=cluster.server, verify=ctx, timeout=30)

    def judge(self, doc: dict[str, Any]) -> tuple[bool, list[tuple[str, str]], str]:
        """(admitted, [(field, message)], the whole answer)."""
        ns = doc["metadata"].get("namespace", "default")
        r = self.http.post(f"/apis/{CRD['spec']['group']}/{ROOT_VERSION}/namespaces/{ns}/{CRD['spec']['names']['plural']}",
                           params={"dryRun": "All", "fieldValidation": "Strict"}, json=doc)
        if r.status_code == 201:
            return True, [], ""
        body = r.json()
        assert r.status_code in (400, 422), (r.status_code, body)
        errors = [(c.get("field") or "<nil>", c.get("message") or "") for c in (body.get("details") or {}).get("causes", [])]
        errors += [(f, "unknown field") for f in re.findall(r'unknown field "([^"]+)"', body.get("message", ""))]
        errors += [(f, "duplicate field") for f in re.findall(r'duplicate field "([^"]+)"', body.get("message", ""))]
        return False, errors, body.get("message", "")


ROOT_VERSION = next(v for v in CRD["spec"]["versions"] if v["storage"])["name"]


def twin(doc: dict[str, Any]) -> tuple[bool, list[str], str]:
    """(admitted, [field paths], the whole message) from `parse_endpoint`."""
    try:
        parse_endpoint(copy.deepcopy(doc))
    except SpecError as e:
        text = str(e)
        paths = [line.split(": ", 1)[0] for line in text.splitlines()[1:] if ": " in line]
        return False, paths, text
    return True, [], ""


# The member of a union pydantic names in an error's location (`spec.rollout.maxUnavailable.int`): not a field.
UNION_MEMBER = re.compile(r"(int|str|float|bool|none|(literal|list|dict|function-\w+|nullable|union)\[.*)")


def _segments(path: str) -> list[str]:
    return [s for s in re.sub(r"\[[^\]]*\]", "", path).split(".") if s and not UNION_MEMBER.fullmatch(s)]


def _related(a: str, b: str) -> bool:
    """One path at or under the other, by whole segments; the document's and spec's own level excepted (a rule
    there says nothing about which field)."""
    sa, sb = _segments(a), _segments(b)
    short = min(len(sa), len(sb))
    return sa == sb or (short >= 2 and sa[:short] == sb[:short])


def same_field(server: list[tuple[str, str]], twin_paths: list[str], twin_text: str) -> bool:
    for field, message in server:
        if any(rule in message and rule in twin_text for rule in RULE_MESSAGES):
            return True  # the same CEL rule, word for word
        if field != "<nil>" and any(_related(field, t) for t in twin_paths):
            return True
    return False


@pytest.fixture(scope="module")
def server(cluster: Cluster) -> Iterator[Server]:
    cluster.kubectl("apply", "--server-side", "-f", str(CRD_FILE))
    cluster.wait_established(CRD["metadata"]["name"])
    for ns in NAMESPACES:
        cluster.kubectl("create", "namespace", ns, check=False)
    judge = Server(cluster)
    yield judge
    judge.http.close()


def test_examples_are_admitted_by_both(server: Server) -> None:
    for doc in BASES:
        assert server.judge(doc)[0], server.judge(doc)[2]
        assert twin(doc)[0], twin(doc)[2]


def test_the_twin_refuses_what_the_server_refuses(server: Server) -> None:
    tally: Counter[str] = Counter()

    @settings(max_examples=SPECS_PER_RUN, deadline=None, database=None, derandomize=False,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
    @given(endpoints())
    def agree(doc: dict[str, Any]) -> None:
        admitted, errors, answer = server.judge(doc)
        twin_admits, paths, text = twin(doc)
        tally["admitted" if admitted else "refused"] += 1
        assert admitted == twin_admits, (
            f"the server {'admits' if admitted else 'refuses'} a spec the twin "
            f"{'admits' if twin_admits else 'refuses'}:\nserver: {answer}\ntwin: {text}\nspec: {doc['spec']}")
        if not admitted:
            assert same_field(errors, paths, text), f"not the same field:\nserver: {answer}\ntwin: {text}"

    agree()
    # Both kinds in numbers, or the test proves little: the examples alone, or nothing but refusals.
    total = tally["admitted"] + tally["refused"]
    assert total >= SPECS_PER_RUN, tally
    assert tally["admitted"] >= total // 10 and tally["refused"] >= total // 10, tally


def test_every_engine_flag_with_every_kind_of_value(server: Server) -> None:
    """engine.args exhaustively: each flag (and a few the operator owns) with each kind of value; the CRD's CEL
    rules and check_arg agree on every one."""
    base = next(b for b in BASES if b["metadata"]["name"] == "smollm2")
    tally: Counter[bool] = Counter()
    for flag in FLAGS:
        for arg in [*INT_OR_STRINGS, 0, 7, -1, "a" * 257]:
            doc = copy.deepcopy(base)
            doc["spec"]["engine"]["args"] = {flag: arg}
            admitted, errors, answer = server.judge(doc)
            twin_admits, paths, text = twin(doc)
            tally[admitted] += 1
            assert admitted == twin_admits, (flag, arg, answer, text)
            if not admitted:
                assert same_field(errors, paths, text), (flag, arg, answer, text)
    assert tally[True] and tally[False], tally
