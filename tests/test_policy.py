"""AttentionPolicy and ModelPolicy: validation, string and JSON round-trips."""

import json

import pytest

from dma_compile.policy import PRESETS, AttentionPolicy, ModelPolicy, as_model_policy, default_policy


def test_default_is_the_paper_configuration():
    p = AttentionPolicy()
    assert (p.tile, p.sink_tiles, p.diag_tiles, p.hi, p.lo, p.pv) == (128, 1, 1, "mxfp8_e4m3", "mxfp4_e2m1", "input")
    assert AttentionPolicy.paper() == p
    assert default_policy("cpu") == p


def test_hopper_preset():
    p = AttentionPolicy.hopper()
    assert (p.hi, p.lo, p.mx_mode, p.pv) == ("none", "mxfp8_e4m3", "folded", "fp8")
    assert AttentionPolicy.preset("hopper_input_pv") == p.replace(pv="input")


@pytest.mark.parametrize(
    "field,value,accepted",
    [
        ("tile", 100, "tile must be one of"),
        ("sink_tiles", -1, "sink_tiles must be an int >= 0"),
        ("diag_tiles", 0, "diag_tiles must be an int >= 1"),
        ("hi", "fp8", "hi must be one of"),
        ("lo", "mxfp6", "lo must be one of"),
        ("pv", "bf16", "pv must be one of"),
        ("mx_mode", "fast", "mx_mode must be one of"),
        ("scale_rule", "ceil", "scale_rule must be one of"),
        ("min_q_len", 0, "min_q_len must be an int >= 1"),
        ("smooth_k", "yes", "smooth_k must be one of"),
    ],
)
def test_validation_names_field_and_accepted_values(field, value, accepted):
    with pytest.raises(ValueError, match=accepted):
        AttentionPolicy(**{field: value})


def test_policy_is_immutable():
    with pytest.raises(Exception):
        AttentionPolicy().tile = 64


@pytest.mark.parametrize("name", list(PRESETS))
def test_string_round_trip(name):
    p = AttentionPolicy.preset(name).replace(tile=64, sink_tiles=2, diag_tiles=3, pv="fp8", min_q_len=5)
    s = p.to_string()
    assert AttentionPolicy.from_string(s) == p
    assert str(p) == s and "," in s and " " not in s


def test_string_partial_keys_and_presets():
    assert AttentionPolicy.from_string("diag=4") == AttentionPolicy(diag_tiles=4)
    assert AttentionPolicy.from_string("hopper") == AttentionPolicy.hopper()


@pytest.mark.parametrize(
    "text,msg",
    [
        ("tile=abc", "integer"),
        ("foo=1", "expected key=value"),
        ("smooth=2", "0 or 1"),
        ("hi=int8", "hi must be one of"),
        ("", "policy string is empty"),
        ("  ", "policy string is empty"),
        ("tile=64,diag=2,tile=128", "key 'tile' is given more than once"),
        ("tile=64,,diag=2", "item '' in 'tile=64,,diag=2'"),
    ],
)
def test_bad_strings(text, msg):
    with pytest.raises(ValueError, match=msg):
        AttentionPolicy.from_string(text)


def test_model_policy_json_round_trip(tmp_path):
    mp = ModelPolicy(
        default=AttentionPolicy.hopper(),
        layers={0: AttentionPolicy(diag_tiles=2), 3: AttentionPolicy.preset("all_mxfp8")},
        num_layers=4,
        stats={"layer_errors": [0.1, 0.2]},
    )
    path = tmp_path / "p.json"
    mp.save(path)
    loaded = ModelPolicy.load(path)
    assert loaded == mp
    assert loaded.for_layer(3) == AttentionPolicy.preset("all_mxfp8")
    assert loaded.for_layer(1) == AttentionPolicy.hopper()
    assert json.loads(path.read_text())["layers"]["0"] == AttentionPolicy(diag_tiles=2).to_string()
    assert as_model_policy(str(path)) == mp


def test_model_policy_errors(tmp_path):
    with pytest.raises(ValueError, match="layer indices"):
        ModelPolicy(layers={5: AttentionPolicy()}, num_layers=4)
    with pytest.raises(ValueError, match="calibrated for a model with 4"):
        ModelPolicy(num_layers=4).check_layers(30)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        ModelPolicy.load(bad)
    with pytest.raises(ValueError, match="cannot be read"):
        ModelPolicy.load(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="ModelPolicy, an AttentionPolicy"):
        as_model_policy(3)


def test_formats_property():
    assert AttentionPolicy.preset("all_mxfp8").formats == ("mxfp8_e4m3",)
    assert AttentionPolicy().formats == ("mxfp8_e4m3", "mxfp4_e2m1")
    assert not AttentionPolicy.preset("exact").uses_mx


def test_policy_hashable_for_caches():
    assert len({AttentionPolicy(), AttentionPolicy(), AttentionPolicy.hopper()}) == 2


@pytest.mark.parametrize(
    "layers,msg",
    [
        ([AttentionPolicy().to_string()], "ModelPolicy.layers must map layer indices to policies .* got list"),
        ({"-1": "paper"}, "key '-1' is not a layer index"),
        ({"first": "paper"}, "key 'first' is not a layer index"),
        ({"1.5": "paper"}, "key '1.5' is not a layer index"),
        ({"2": "tile=7"}, r"ModelPolicy.layers\[2\]: AttentionPolicy.tile must be one of"),
        ({"2": None}, r"ModelPolicy.layers\[2\]: expected a policy"),
        ({"1": "paper", "01": "hopper"}, "layer 1 is given more than once"),
    ],
)
def test_model_policy_json_layers_are_checked(tmp_path, layers, msg):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"default": "paper", "layers": layers}))
    with pytest.raises(ValueError, match=msg):
        ModelPolicy.load(path)


def test_model_policy_layer_keys_in_python():
    assert ModelPolicy(layers={"3": "hopper", 0: AttentionPolicy()}).layers == {3: AttentionPolicy.hopper(), 0: AttentionPolicy()}
    with pytest.raises(ValueError, match="key -1 is not a layer index"):
        ModelPolicy(layers={-1: AttentionPolicy()})
    with pytest.raises(ValueError, match="key True is not a layer index"):
        ModelPolicy(layers={True: AttentionPolicy()})


@pytest.mark.parametrize(
    "field,value,accepted",
    [
        ("cache_k", "fp8", "cache_k must be one of"),
        ("cache_v", "mxfp4_e2m1", "cache_v must be one of"),
        ("recent_tokens", -1, "recent_tokens must be an int >= 0"),
        ("recent_tokens", 1.5, "recent_tokens must be an int >= 0"),
    ],
)
def test_cache_fields_validated(field, value, accepted):
    with pytest.raises(ValueError, match=accepted):
        AttentionPolicy(**{field: value})


def test_cache_fields_round_trip_string_and_json(tmp_path):
    p = AttentionPolicy.hopper().replace(cache_k="mxfp4_e2m1", cache_v="mxfp8_e4m3", recent_tokens=37)
    assert AttentionPolicy.from_string(p.to_string()) == p
    assert "kcache=mxfp4_e2m1" in p.to_string() and "recent=37" in p.to_string()
    assert AttentionPolicy.from_string("kcache=mxfp8_e4m3").cache_k == "mxfp8_e4m3"
    model = ModelPolicy(default=AttentionPolicy(), layers={1: p}, num_layers=2)
    model.save(tmp_path / "p.json")
    assert ModelPolicy.load(tmp_path / "p.json").layers[1] == p
    assert AttentionPolicy().cache_k == "none" and AttentionPolicy().recent_tokens == 128


def test_rotate_field_validated_and_default_none():
    assert AttentionPolicy().rotate == "none"
    with pytest.raises(ValueError, match="rotate must be one of"):
        AttentionPolicy(rotate="walsh")
    with pytest.raises(ValueError, match="rotate must be one of"):
        AttentionPolicy.from_string("rot=yes")


def test_rotate_string_form_is_backward_compatible():
    """Strings written before the field parse to rotate=none, and a policy
    without rotation writes exactly the string it wrote then."""
    old = ("tile=128,sink=1,diag=1,hi=mxfp8_e4m3,lo=mxfp4_e2m1,pv=input,mx=exact,smooth=1,scale=rceil,minq=16,"
           "kcache=none,vcache=none,recent=128")
    assert AttentionPolicy().to_string() == old
    assert AttentionPolicy.from_string(old) == AttentionPolicy()
    p = AttentionPolicy.hopper().replace(rotate="signed_hadamard")
    assert p.to_string() == AttentionPolicy.hopper().to_string() + ",rot=signed_hadamard"
    assert AttentionPolicy.from_string(p.to_string()) == p
    assert AttentionPolicy.from_string("rot=hadamard") == AttentionPolicy(rotate="hadamard")
    assert AttentionPolicy.from_string("rot=none") == AttentionPolicy()
    assert "rot=" not in AttentionPolicy(rotate="none").to_string()


def test_rotate_round_trips_per_layer_json(tmp_path):
    rotated = AttentionPolicy.preset("all_mxfp4").replace(rotate="hadamard")
    model = ModelPolicy(default=AttentionPolicy.hopper(), layers={0: rotated, 2: rotated.replace(rotate="none")},
                        num_layers=3)
    model.save(tmp_path / "p.json")
    back = ModelPolicy.load(tmp_path / "p.json")
    assert back.layers[0] == rotated and back.layers[2].rotate == "none" and back.default == model.default
    assert json.loads((tmp_path / "p.json").read_text())["layers"]["0"].endswith(",rot=hadamard")
    assert AttentionPolicy.from_dict(rotated.to_dict()) == rotated


def test_rotates_cache_only_when_k_is_quantized():
    assert not AttentionPolicy(rotate="hadamard").rotates_cache
    assert AttentionPolicy(rotate="hadamard", cache_k="mxfp4_e2m1").rotates_cache
    assert not AttentionPolicy(cache_k="mxfp4_e2m1").rotates_cache


def test_rotated_presets():
    assert AttentionPolicy.preset("paper_rotated") == AttentionPolicy(rotate="signed_hadamard")
    rotated = AttentionPolicy.from_string("all_mxfp4_rotated")
    assert rotated == AttentionPolicy.preset("all_mxfp4").replace(rotate="signed_hadamard")
    # The unrotated presets and the device defaults stay as they were.
    assert all(AttentionPolicy.preset(n).rotate == "none" for n in ("paper", "hopper", "all_mxfp8", "all_mxfp4"))
    assert default_policy("cpu").rotate == "none"


def test_balance_field_validated_and_left_out_of_old_strings():
    """balance_qk defaults to off and stays out of the string form there, so
    strings written before the field name the same policy; on, it round-trips."""
    assert AttentionPolicy().balance_qk is False
    assert "balance" not in AttentionPolicy.hopper().to_string()
    p = AttentionPolicy.paper().replace(rotate="signed_hadamard", balance_qk=True)
    assert p.to_string().endswith(",rot=signed_hadamard,balance=1")
    assert AttentionPolicy.from_string(p.to_string()) == p
    with pytest.raises(ValueError, match="balance_qk must be one of"):
        AttentionPolicy(balance_qk="yes")
    with pytest.raises(ValueError, match="balance must be 0 or 1"):
        AttentionPolicy.from_string("balance=2")
