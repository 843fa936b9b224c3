//! SPEC.md section 2, step by step, plus snapshots, batches and counters.

use kvrelay::hints::DEFAULT_MAX_BYTES;
use kvrelay::{Admission, AdmissionConfig, BatchOutcome, CounterValues, Ignored, Outcome, Reason, Where};

fn trusted() -> Admission {
    Admission::new(AdmissionConfig { trusted: true, ..Default::default() }).unwrap()
}

/// An envelope with one action whose payload member `x` holds `value` (raw JSON text).
fn with_payload(value: &str) -> String {
    format!(
        r#"{{"protocol_version":"0.1","message_id":"m","actions":[{{"action_id":"a","action_type":"kv.fetch","action_version":"1.0","payload":{{"x":{value}}}}}]}}"#
    )
}

/// An envelope with a root extra-metadata member `extra` holding `value`.
fn with_extra(value: &str) -> String {
    format!(r#"{{"protocol_version":"0.1","message_id":"m","actions":[],"extra":{value}}}"#)
}

fn outcome(edge: &Admission, raw: &str) -> Outcome {
    edge.admit(Some(raw.as_bytes()))
}

#[track_caller]
fn assert_ignored(o: Outcome, reason: Reason) -> Ignored {
    match o {
        Outcome::Ignored(i) if i.reason == reason => {
            assert_eq!(i.detail.is_some(), reason == Reason::Malformed, "detail only for malformed: {i:?}");
            i
        }
        other => panic!("expected ignored({reason}), got {other:?}"),
    }
}

#[track_caller]
fn assert_admitted(o: Outcome) -> kvrelay::Snapshot {
    match o {
        Outcome::Admitted(s) => s,
        other => panic!("expected admitted, got {other:?}"),
    }
}

#[track_caller]
fn malformed_what(edge: &Admission, raw: &str) -> &'static str {
    assert_ignored(outcome(edge, raw), Reason::Malformed).detail.unwrap().what()
}

#[test]
fn step1_absent_is_not_counted_even_untrusted() {
    for edge in [trusted(), Admission::new(AdmissionConfig::default()).unwrap()] {
        for raw in ["", "   ", "null", " \n null\t"] {
            assert_eq!(outcome(&edge, raw), Outcome::Absent, "{raw:?}");
        }
        assert_eq!(edge.admit(None), Outcome::Absent);
        assert_eq!(edge.counters().values(), CounterValues::default());
    }
}

#[test]
fn step2_untrusted_strips_before_any_validation() {
    let edge = Admission::new(AdmissionConfig::default()).unwrap();
    assert!(!edge.config().trusted, "trust is off by default");
    for raw in [with_payload("1"), "{not json".to_string(), "x".repeat(2 << 20)] {
        assert_ignored(outcome(&edge, &raw), Reason::Untrusted);
    }
    assert_eq!(edge.counters().values().untrusted, 3);
    assert_eq!(edge.counters().values().malformed + edge.counters().values().oversized, 0);
}

#[test]
fn trust_from_env_reads_the_named_variable() {
    // A variable name private to this test, so parallel tests cannot interfere.
    let var = "KVRELAY_TEST_TRUST_FROM_ENV";
    std::env::remove_var(var);
    assert!(!AdmissionConfig::default().trust_from_env(var).trusted);
    for (v, want) in
        [("1", true), ("TRUE", true), (" on ", true), ("yes", true), ("0", false), ("no", false), ("", false)]
    {
        std::env::set_var(var, v);
        assert_eq!(AdmissionConfig::default().trust_from_env(var).trusted, want, "{v:?}");
    }
    std::env::remove_var(var);
}

#[test]
fn step3_raw_limit_before_parsing() {
    let edge = Admission::new(AdmissionConfig { trusted: true, max_raw_bytes: 100, ..Default::default() }).unwrap();
    // malformed and over the raw limit: oversized wins, nothing parsed
    assert_ignored(outcome(&edge, &format!("{{{}", " ".repeat(200))), Reason::Oversized);
    // exactly at the raw limit is parsed
    let raw = format!("{:<100}", r#"{"protocol_version":"0.1","message_id":"m","actions":[]}"#);
    assert_eq!(raw.len(), 100);
    assert_admitted(outcome(&edge, &raw));
}

#[test]
fn step4_syntax_utf8_surrogates() {
    let edge = trusted();
    for bad in [
        "{",
        r#"{"protocol_version":"0.1",}"#,
        r#"{"protocol_version":'0.1'}"#,
        r#"{"protocol_version":"0.1"} {}"#,
        r#"{"a":01}"#,
        r#"{"a":"\ud800"}"#,
        r#"{"a":"\udc00\ud800"}"#,
        r#"{"a":"\x"}"#,
        r#"{"a":NaN}"#,
        "{\"a\":\"\t\"}",
    ] {
        assert_ignored(outcome(&edge, bad), Reason::Malformed);
    }
    for bytes in [
        &b"{\"a\":\"\xff\"}"[..],
        b"{\"a\":\"\xc0\xaf\"}",
        b"{\"a\":\"\xed\xa0\x80\"}",
        b"{\"a\":\"\xf4\x90\x80\x80\"}",
    ] {
        let i = assert_ignored(edge.admit(Some(bytes)), Reason::Malformed);
        assert_eq!(i.detail.unwrap().what(), "invalid UTF-8");
    }
    // a syntax error late in the input outranks a future version early in it
    assert_ignored(outcome(&edge, r#"{"protocol_version":"9.9","x":[1,]}"#), Reason::Malformed);
}

fn nested(depth: usize) -> String {
    // the envelope root is depth 1, payload depth 4, so `x` holds depth - 4 more levels
    let inner = depth - 4;
    with_payload(&format!("{}{}", "[".repeat(inner), "]".repeat(inner)))
}

#[test]
fn step4_depth_at_and_past_the_limit() {
    let edge = trusted();
    assert_admitted(outcome(&edge, &nested(128)));
    assert_eq!(malformed_what(&edge, &nested(129)), "nesting deeper than max_depth");
    let small = Admission::new(AdmissionConfig { trusted: true, max_depth: 5, ..Default::default() }).unwrap();
    assert_admitted(outcome(&small, &nested(5)));
    assert_ignored(outcome(&small, &nested(6)), Reason::Malformed);
    // far past the limit: no stack overflow, a clean outcome
    assert_ignored(outcome(&edge, &"[".repeat(100_000)), Reason::Malformed);
}

#[test]
fn step4_duplicate_member_names_anywhere() {
    let edge = trusted();
    let dup = "duplicate member name in the object";
    assert_eq!(malformed_what(&edge, r#"{"protocol_version":"0.1","protocol_version":"0.1"}"#), dup);
    assert_eq!(malformed_what(&edge, &with_payload(r#"{"k":1,"k":2}"#)), dup);
    // equal after decoding escapes
    assert_eq!(malformed_what(&edge, &with_payload(r#"{"k":1,"\u006b":2}"#)), dup);
    // many members: the sorted path
    let many: Vec<String> = (0..100).map(|i| format!("\"k{i}\":{i}")).collect();
    assert_admitted(outcome(&edge, &with_payload(&format!("{{{}}}", many.join(",")))));
    assert_eq!(malformed_what(&edge, &with_payload(&format!("{{{},\"k57\":0}}", many.join(",")))), dup);
    // same name in sibling objects is fine
    assert_admitted(outcome(&edge, &with_payload(r#"[{"k":1},{"k":2}]"#)));
    // a duplicate in a future version is still malformed (step 4 before step 6)
    assert_ignored(outcome(&edge, r#"{"protocol_version":"2","a":1,"a":1}"#), Reason::Malformed);
}

#[test]
fn step5_root_not_an_object() {
    let edge = trusted();
    for raw in ["[]", "1", "\"0.1\"", "true", "[{\"protocol_version\":\"0.1\"}]"] {
        assert_eq!(malformed_what(&edge, raw), "root is not an object", "{raw}");
    }
}

#[test]
fn step6_protocol_version() {
    let edge = trusted();
    let what = "protocol_version is missing or not a string";
    assert_eq!(malformed_what(&edge, r#"{"message_id":"m","actions":[]}"#), what);
    assert_eq!(malformed_what(&edge, r#"{"protocol_version":0.1,"message_id":"m","actions":[]}"#), what);
    assert_eq!(malformed_what(&edge, r#"{"protocol_version":null}"#), what);
    // a future version with an otherwise invalid body: its fields are never interpreted
    for raw in [
        r#"{"protocol_version":"0.2"}"#,
        r#"{"protocol_version":"1.0","actions":"nope","message_id":7}"#,
        r#"{"actions":[1,2,3],"protocol_version":"0.10"}"#,
        r#"{"protocol_version":"0.1 "}"#,
        r#"{"protocol_version":"","x":99999999999999999999999}"#,
    ] {
        assert_ignored(outcome(&edge, raw), Reason::UnknownVersion);
    }
    // a future version outranks oversized
    let big = format!(r#"{{"protocol_version":"0.2","pad":"{}"}}"#, "x".repeat(70_000));
    assert_ignored(outcome(&edge, &big), Reason::UnknownVersion);
    // "0.1" spelled with escapes is 0.1
    assert_admitted(outcome(&edge, r#"{"protocol_version":"0\u002e1","message_id":"m","actions":[]}"#));
}

/// An admitted envelope of exactly `size` canonical bytes whose raw text is padded with
/// whitespace so that it is larger than the canonical encoding.
fn sized_envelope(size: usize) -> String {
    let base = r#"{"protocol_version":"0.1","message_id":"m","actions":[],"pad":""}"#.len();
    let pad = "p".repeat(size - base);
    format!(
        "{{ \"protocol_version\" : \"0.1\",\n  \"message_id\": \"m\",\n  \"actions\": [ ],\n  \"pad\": \"{pad}\"\n}}\n"
    )
}

#[test]
fn step7_canonical_size_limit_not_raw_size() {
    let edge = trusted();
    let at = sized_envelope(DEFAULT_MAX_BYTES);
    assert!(at.len() > DEFAULT_MAX_BYTES, "the raw text is larger than the limit");
    let s = assert_admitted(outcome(&edge, &at));
    assert_eq!(s.canonical_len(), 65_536);
    assert_ignored(outcome(&edge, &sized_envelope(DEFAULT_MAX_BYTES + 1)), Reason::Oversized);
    // a hash array is never truncated: the whole hint is dropped
    let hashes: Vec<String> = (0..4000u64).map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15).to_string()).collect();
    assert_ignored(outcome(&edge, &with_payload(&format!("[{}]", hashes.join(",")))), Reason::Oversized);
    // oversized outranks step-8 problems
    let big_bad = format!(r#"{{"protocol_version":"0.1","x":18446744073709551616,"pad":"{}"}}"#, "x".repeat(70_000));
    assert_ignored(outcome(&edge, &big_bad), Reason::Oversized);
}

#[test]
fn step8_integer_range_in_payload_and_extra_metadata() {
    let edge = trusted();
    for wrap in [with_payload as fn(&str) -> String, with_extra] {
        for ok in ["18446744073709551615", "-9223372036854775808", "0", "-0", "9223372036854775807", "-1"] {
            assert_admitted(outcome(&edge, &wrap(ok)));
        }
        for bad in ["18446744073709551616", "-9223372036854775809", "99999999999999999999", "100000000000000000000000"]
        {
            assert_eq!(malformed_what(&edge, &wrap(bad)), "integer outside -2^63 ..= 2^64-1", "{bad}");
        }
        for ok in ["1e308", "-1.7976931348623157e308", "1e-400", "0.5"] {
            assert_admitted(outcome(&edge, &wrap(ok)));
        }
        for bad in ["1e309", "-1e309", "1.8e308"] {
            assert_eq!(malformed_what(&edge, &wrap(bad)), "number is not finite as an f64", "{bad}");
        }
    }
}

#[test]
fn step8_structure_of_0_1() {
    let edge = trusted();
    let root = |body: &str| format!(r#"{{"protocol_version":"0.1",{body}}}"#);
    let action = |a: &str| root(&format!(r#""message_id":"m","actions":[{a}]"#));
    let cases: Vec<(String, &str)> = vec![
        (root(r#""actions":[]"#), "message_id is missing or not a string"),
        (root(r#""message_id":true,"actions":[]"#), "message_id is missing or not a string"),
        (root(r#""message_id":"m""#), "actions is missing or not an array"),
        (root(r#""message_id":"m","actions":"a1""#), "actions is missing or not an array"),
        (root(r#""message_id":"m","actions":{}"#), "actions is missing or not an array"),
        (action(r#""a1""#), "action is not an object"),
        (action(r#"{"action_type":"t","action_version":"1","payload":{}}"#), "action_id is missing or not a string"),
        (
            action(r#"{"action_id":1,"action_type":"t","action_version":"1","payload":{}}"#),
            "action_id is missing or not a string",
        ),
        (
            action(r#"{"action_id":"a","action_type":false,"action_version":"1","payload":{}}"#),
            "action_type is missing or not a string",
        ),
        (
            action(r#"{"action_id":"a","action_type":"t","action_version":1.0,"payload":{}}"#),
            "action_version is missing or not a string",
        ),
        (action(r#"{"action_id":"a","action_type":"t","action_version":"1"}"#), "payload is missing or not an object"),
        (
            action(r#"{"action_id":"a","action_type":"t","action_version":"1","payload":[1]}"#),
            "payload is missing or not an object",
        ),
        (
            action(r#"{"action_id":"a","action_type":"t","action_version":"1","payload":"{}"}"#),
            "payload is missing or not an object",
        ),
        (
            action(r#"{"action_id":"a","action_type":"t","action_version":"1","payload":null}"#),
            "payload is missing or not an object",
        ),
    ];
    for (raw, what) in cases {
        assert_eq!(malformed_what(&edge, &raw), what, "{raw}");
    }
    // the place of an action problem is the action, and a good first action is not salvaged
    let two = action(r#"{"action_id":"a","action_type":"t","action_version":"1","payload":{}},{"action_id":"b"}"#);
    let d = assert_ignored(outcome(&edge, &two), Reason::Malformed).detail.unwrap();
    assert_eq!(d.place(), Where::Action(1));
    assert_eq!(d.to_string(), "action_type is missing or not a string in actions[1]");
}

#[test]
fn details_never_carry_hint_contents() {
    let edge = trusted();
    let secret = "SECRET-TOKEN";
    for raw in [
        format!(r#"{{"protocol_version":"0.1","message_id":"{secret}","actions":[{{"action_id":"{secret}"}}]}}"#),
        format!(r#"{{"protocol_version":"0.1","{secret}":1,"{secret}":2}}"#),
        format!(r#"{{"protocol_version":"0.1","message_id":"{secret}\q"}}"#),
    ] {
        let i = assert_ignored(outcome(&edge, &raw), Reason::Malformed);
        assert!(!i.to_string().contains(secret), "{i}");
        assert!(!format!("{i:?}").contains(secret));
    }
}

#[test]
fn escaped_action_strings_are_decoded_in_every_slot() {
    // Escaped and plain id, type and version strings in every combination over several actions:
    // the snapshot's decoded texts land in its extra area in action order, each in its slot.
    let edge = trusted();
    let texts = ["p", "e\\u00e9\\\"", "t\\n\\u0000x", "\\ud83d\\ude00"];
    let decoded = ["p", "e\u{e9}\"", "t\n\u{0}x", "\u{1F600}"];
    let mut actions = Vec::new();
    let mut want = Vec::new();
    for i in 0..texts.len().pow(3) {
        let (a, b, c) = (i % 4, i / 4 % 4, i / 16);
        actions.push(format!(
            r#"{{"action_id":"{}","action_type":"{}","action_version":"{}","payload":{{}}}}"#,
            texts[a], texts[b], texts[c]
        ));
        want.push((decoded[a], decoded[b], decoded[c]));
    }
    let raw = format!(r#"{{"protocol_version":"0.1","message_id":"{}","actions":[{}]}}"#, texts[1], actions.join(","));
    let s = assert_admitted(outcome(&edge, &raw));
    assert_eq!(s.message_id(), decoded[1]);
    let got: Vec<(&str, &str, &str)> = s.actions().map(|a| (a.id(), a.action_type(), a.version())).collect();
    assert_eq!(got, want);
}

#[test]
fn step9_admitted_keeps_everything() {
    let edge = trusted();
    let raw = r#"{"protocol_version":"0.1","message_id":"m\"1","actions":[
        {"action_id":"a","action_type":"kv.fetch","action_version":"1.0","payload":{"block_hashes":[1,2]},"note":{"k":[true,null]}},
        {"action_id":"a","action_type":"kv.teleport","action_version":"7.3-beta","payload":{"anything":{"goes":[1.5e3]}}},
        {"action_id":"a\u0000","action_type":"kv.fetch","action_version":"2.0","payload":{}}
    ],"trace":{"id":"t-1"},"z":-0}"#;
    let s = assert_admitted(outcome(&edge, raw));
    assert_eq!(s.protocol_version(), "0.1");
    assert_eq!(s.message_id(), "m\"1");
    assert_eq!(s.action_count(), 3, "repeated action ids are kept");
    let ids: Vec<&str> = s.actions().map(|a| a.id()).collect();
    assert_eq!(ids, ["a", "a", "a\0"]);
    let b = s.action(1).unwrap();
    assert_eq!((b.action_type(), b.version()), ("kv.teleport", "7.3-beta"), "unknown types and versions kept");
    assert_eq!(b.payload(), br#"{"anything":{"goes":[1500.0]}}"#);
    assert_eq!(s.action(0).unwrap().canonical(), br#"{"action_id":"a","action_type":"kv.fetch","action_version":"1.0","payload":{"block_hashes":[1,2]},"note":{"k":[true,null]}}"#);
    assert!(s.action(3).is_none());
    let canon = std::str::from_utf8(s.canonical()).unwrap();
    assert!(canon.ends_with(r#""trace":{"id":"t-1"},"z":0}"#), "{canon}");
    assert!(canon.contains(r#""action_id":"a\u0000""#));
    // decode is an independent copy equal to serde_json's reading, except that SPEC.md makes
    // the integer -0 into 0 where serde_json reads it as the float -0.0
    let v = s.decode();
    let mut want: serde_json::Value = serde_json::from_str(raw).unwrap();
    assert!(want["z"].as_f64() == Some(0.0) && want["z"].is_f64());
    want["z"] = serde_json::json!(0);
    assert_eq!(v, want);
    assert_eq!(v["trace"]["id"], "t-1");
}

#[test]
fn text_representations_hide_contents() {
    let s = assert_admitted(outcome(&trusted(), &with_payload(r#""SECRET""#)));
    for text in [
        format!("{s}"),
        format!("{s:?}"),
        format!("{:?}", s.action(0).unwrap()),
        format!("{:?}", s.action_envelope(0).unwrap()),
    ] {
        for content in ["SECRET", "kv.fetch", "\"m\"", "1.0"] {
            assert!(!text.contains(content), "{text}");
        }
    }
}

#[test]
fn caller_mutation_cannot_change_a_snapshot() {
    let mut raw = with_payload("[1,2]").into_bytes();
    let s = assert_admitted(trusted().admit(Some(&raw)));
    let before = s.canonical().to_vec();
    raw.iter_mut().for_each(|b| *b = b'!');
    assert_eq!(s.canonical(), &before[..]);
}

#[test]
fn one_action_envelopes_share_and_serialize() {
    let edge = trusted();
    let raw = r#"{"protocol_version":"0.1","pre":1,"message_id":"m","actions":[{"action_id":"a","action_type":"t","action_version":"1","payload":{"p":1}},{"action_id":"b","action_type":"u","action_version":"2","payload":{}}],"post":[2]}"#;
    let s = assert_admitted(outcome(&edge, raw));
    let v = s.action_envelope(1).unwrap();
    assert!(kvrelay::Snapshot::ptr_eq(v.snapshot(), &s), "the view shares the snapshot");
    let bytes = v.to_canonical();
    assert_eq!(bytes.len(), v.canonical_len());
    assert_eq!(
        std::str::from_utf8(&bytes).unwrap(),
        r#"{"protocol_version":"0.1","pre":1,"message_id":"m","actions":[{"action_id":"b","action_type":"u","action_version":"2","payload":{}}],"post":[2]}"#
    );
    // the one-action envelope is itself an admissible canonical envelope
    let again = assert_admitted(edge.admit(Some(&bytes)));
    assert_eq!(again.canonical(), &bytes[..]);
    assert_eq!(again.action(0).unwrap().id(), "b");
    assert!(s.action_envelope(2).is_none());
}

#[test]
fn msgpack_round_trip_and_revalidation() {
    let edge = trusted();
    let raw = with_payload(
        r#"{"h":[18446744073709551615,-9223372036854775808,0,1.5,-0.0,1e300],"s":"é\n\u0001","b":[true,false,null]}"#,
    );
    let s = assert_admitted(outcome(&edge, &raw));
    let mp = s.to_msgpack();
    let back = edge.decode_msgpack(&mp).unwrap();
    assert_eq!(back.canonical(), s.canonical());
    assert_eq!(kvrelay::Snapshot::from_msgpack(&mp).unwrap(), s);
    // decoding re-validates: a map with a duplicate key, a non-string key, a wrong version,
    // trailing bytes and truncation are all refused
    let mut dup = Vec::new();
    rmp::encode::write_map_len(&mut dup, 2).unwrap();
    for _ in 0..2 {
        rmp::encode::write_str(&mut dup, "protocol_version").unwrap();
        rmp::encode::write_str(&mut dup, "0.1").unwrap();
    }
    assert_eq!(edge.decode_msgpack(&dup).unwrap_err().reason, Reason::Malformed);
    let mut intkey = Vec::new();
    rmp::encode::write_map_len(&mut intkey, 1).unwrap();
    rmp::encode::write_uint(&mut intkey, 1).unwrap();
    rmp::encode::write_nil(&mut intkey).unwrap();
    assert_eq!(edge.decode_msgpack(&intkey).unwrap_err().detail.unwrap().what(), "MessagePack map key is not a string");
    let mut v2 = Vec::new();
    rmp::encode::write_map_len(&mut v2, 1).unwrap();
    rmp::encode::write_str(&mut v2, "protocol_version").unwrap();
    rmp::encode::write_str(&mut v2, "0.2").unwrap();
    assert_eq!(edge.decode_msgpack(&v2).unwrap_err().reason, Reason::UnknownVersion);
    let mut trailing = mp.clone();
    trailing.push(0xc0);
    assert_eq!(edge.decode_msgpack(&trailing).unwrap_err().reason, Reason::Malformed);
    for cut in [1, mp.len() / 2, mp.len() - 1] {
        assert_eq!(edge.decode_msgpack(&mp[..cut]).unwrap_err().reason, Reason::Malformed);
    }
    // a hostile length prefix does not allocate or hang
    assert_eq!(edge.decode_msgpack(&[0xdd, 0xff, 0xff, 0xff, 0xff]).unwrap_err().reason, Reason::Malformed);
    // deep nesting is refused before the text is built
    let deep = [0x91u8; 10_000];
    assert_eq!(edge.decode_msgpack(&deep).unwrap_err().reason, Reason::Malformed);
    // NaN has no JSON form
    let mut nan = Vec::new();
    rmp::encode::write_map_len(&mut nan, 1).unwrap();
    rmp::encode::write_str(&mut nan, "x").unwrap();
    rmp::encode::write_f64(&mut nan, f64::NAN).unwrap();
    assert_eq!(edge.decode_msgpack(&nan).unwrap_err().reason, Reason::Malformed);
    // decoding counts nothing: the hint was counted where it entered
    assert_eq!(edge.counters().values().admitted, 1);
}

#[test]
fn batched_requests() {
    let edge = trusted();
    let one = with_payload("[1]");
    // a single envelope is admitted once and shared by every prompt
    match edge.admit_batch(Some(one.as_bytes()), 4).unwrap() {
        BatchOutcome::Shared(Outcome::Admitted(_)) => {}
        other => panic!("{other:?}"),
    }
    assert_eq!(edge.counters().values().admitted, 1);
    // an aligned list: one outcome per prompt, null entries absent
    let list = format!("[ {one}, null, {{\"protocol_version\":\"0.9\"}}, {one} ]");
    let BatchOutcome::PerPrompt(v) = edge.admit_batch(Some(list.as_bytes()), 4).unwrap() else { panic!() };
    assert!(matches!(v[0], Outcome::Admitted(_)));
    assert_eq!(v[1], Outcome::Absent);
    assert_ignored(v[2].clone(), Reason::UnknownVersion);
    assert_eq!(v[3].snapshot().unwrap(), v[0].snapshot().unwrap());
    // a length mismatch is a request error and counts nothing
    let before = edge.counters().values();
    let e = edge.admit_batch(Some(list.as_bytes()), 3).unwrap_err();
    assert_eq!((e.entries, e.prompts), (4, 3));
    assert_eq!(edge.counters().values(), before);
    // an entry with duplicate members is that entry's problem only
    let dup = format!("[{one}, {{\"a\":1,\"a\":2}}]");
    let BatchOutcome::PerPrompt(v) = edge.admit_batch(Some(dup.as_bytes()), 2).unwrap() else { panic!() };
    assert!(matches!(v[0], Outcome::Admitted(_)));
    assert_ignored(v[1].clone(), Reason::Malformed);
    // a list that is not JSON is one malformed hint for everyone
    assert!(matches!(edge.admit_batch(Some(b"[{]"), 1).unwrap(), BatchOutcome::Shared(Outcome::Ignored(_))));
    // absent and untrusted
    assert_eq!(edge.admit_batch(Some(b"null"), 2).unwrap(), BatchOutcome::Shared(Outcome::Absent));
    let off = Admission::new(AdmissionConfig::default()).unwrap();
    match off.admit_batch(Some(b"[1,2,3]"), 2).unwrap() {
        BatchOutcome::Shared(o) => assert_ignored(o, Reason::Untrusted),
        other => panic!("{other:?}"),
    };
}

#[test]
fn counters_and_prometheus() {
    let edge = Admission::new(AdmissionConfig {
        trusted: true,
        metric_prefix: "trtllm_kv_hints".into(),
        ..Default::default()
    })
    .unwrap();
    edge.admit(Some(with_payload("1").as_bytes()));
    edge.admit(Some(b"{"));
    edge.admit(Some(b"{\"protocol_version\":\"3\"}"));
    edge.admit(Some(sized_envelope(70_000).as_bytes()));
    edge.admit(Some(b"null"));
    let v = edge.counters().values();
    assert_eq!((v.admitted, v.malformed, v.unknown_version, v.oversized, v.untrusted), (1, 1, 1, 1, 0));
    let text = edge.prometheus();
    for line in [
        "# HELP trtllm_kv_hints_admitted_total ",
        "# TYPE trtllm_kv_hints_admitted_total counter\n",
        "trtllm_kv_hints_admitted_total 1\n",
        "# TYPE trtllm_kv_hints_ignored_total counter\n",
        "trtllm_kv_hints_ignored_total{reason=\"malformed\"} 1\n",
        "trtllm_kv_hints_ignored_total{reason=\"untrusted\"} 0\n",
        "trtllm_kv_hints_ignored_total{reason=\"unknown_version\"} 1\n",
        "trtllm_kv_hints_ignored_total{reason=\"oversized\"} 1\n",
    ] {
        assert!(text.contains(line), "missing {line:?} in\n{text}");
    }
    assert!(text.ends_with('\n'));
}

#[test]
fn config_is_validated() {
    use kvrelay::hints::ConfigError;
    let bad = |c: AdmissionConfig| Admission::new(c).unwrap_err();
    assert_eq!(bad(AdmissionConfig { max_bytes: 0, ..Default::default() }), ConfigError::Limit("max_bytes"));
    assert_eq!(bad(AdmissionConfig { max_depth: 0, ..Default::default() }), ConfigError::Limit("max_depth"));
    assert_eq!(bad(AdmissionConfig { max_depth: 100_000, ..Default::default() }), ConfigError::Limit("max_depth"));
    assert_eq!(
        bad(AdmissionConfig { max_raw_bytes: usize::MAX, ..Default::default() }),
        ConfigError::Limit("max_raw_bytes")
    );
    assert_eq!(bad(AdmissionConfig { metric_prefix: "9bad".into(), ..Default::default() }), ConfigError::MetricPrefix);
    assert_eq!(bad(AdmissionConfig { metric_prefix: "a b".into(), ..Default::default() }), ConfigError::MetricPrefix);
}

/// Long comma-separated number lists (the hash-list fast paths) against an independent
/// expectation: every boundary the fast path decides on, mixed at random positions.
#[test]
fn number_lists_at_every_boundary() {
    let edge = trusted();
    // (text, in range, canonical)
    let pool: &[(&str, bool, &str)] = &[
        ("0", true, "0"),
        ("7", true, "7"),
        ("1234567890123456789", true, "1234567890123456789"),
        ("9999999999999999999", true, "9999999999999999999"),
        ("18446744073709551615", true, "18446744073709551615"),
        ("18446744073709551616", false, ""),
        ("18446744073709551699", false, ""),
        ("18446744000000000000", true, "18446744000000000000"),
        ("18446743999999999999", true, "18446743999999999999"),
        ("18446745000000000000", false, ""),
        ("99999999999999999999", false, ""),
        ("100000000000000000000", false, ""),
        ("-1", true, "-1"),
        ("-0", true, "0"),
        ("-9223372036854775808", true, "-9223372036854775808"),
        ("-9223372036854775809", false, ""),
        ("1.5", true, "1.5"),
        ("1e5", true, "100000.0"),
        ("12345678901234567890", true, "12345678901234567890"),
    ];
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    for case in 0..3000 {
        let n = 1 + (next() % 60) as usize;
        // mostly plain random u64s, sometimes a boundary element
        let elems: Vec<(String, bool, String)> = (0..n)
            .map(|_| {
                if next() % 4 == 0 {
                    let (t, ok, c) = pool[(next() % pool.len() as u64) as usize];
                    (t.to_string(), ok, c.to_string())
                } else {
                    let v = next() >> (next() % 64);
                    (v.to_string(), true, v.to_string())
                }
            })
            .collect();
        // separators: compact, spaced (`, `, the spaced block scanner), or any whitespace
        // around each comma (the general path), chosen per list
        let seps = [",", ", ", ",  ", " ,", " , ", ",\t", ",\n  ", ", \r\n"];
        let mode = next() % 3;
        let mut text = String::new();
        for (i, e) in elems.iter().enumerate() {
            if i > 0 {
                text.push_str(match mode {
                    0 => ",",
                    1 => ", ",
                    _ => seps[(next() % seps.len() as u64) as usize],
                });
            }
            text.push_str(&e.0);
        }
        let raw = with_payload(&format!("[{text}]"));
        let all_ok = elems.iter().all(|e| e.1);
        match edge.admit(Some(raw.as_bytes())) {
            Outcome::Admitted(s) => {
                assert!(all_ok, "case {case}: admitted with an out-of-range integer: {text}");
                let canon = elems.iter().map(|e| e.2.as_str()).collect::<Vec<_>>().join(",");
                assert_eq!(s.action(0).unwrap().payload(), format!(r#"{{"x":[{canon}]}}"#).as_bytes(), "case {case}");
            }
            Outcome::Ignored(i) => {
                assert!(!all_ok, "case {case}: refused a valid list ({i}): {text}");
                assert_eq!(i.detail.unwrap().what(), "integer outside -2^63 ..= 2^64-1", "case {case}");
            }
            Outcome::Absent => panic!("case {case}"),
        }
    }
    // malformed separators and leading zeros inside a long run are still caught
    let long: Vec<String> = (0..40u64).map(|i| (i * 1_000_000_007 + 10).to_string()).collect();
    for sep in [",", ", "] {
        for (i, bad) in ["01", "", " ", "00", "1.", "--1", "+1", "0x10"].iter().enumerate() {
            let mut v = long.clone();
            v[5 + i * 3] = bad.to_string();
            let raw = with_payload(&format!("[{}]", v.join(sep)));
            // (" " leaves ", ,": whitespace is insignificant, the element is still empty)
            let o = edge.admit(Some(raw.as_bytes()));
            assert!(matches!(o, Outcome::Ignored(ref i) if i.reason == Reason::Malformed), "{sep:?} {bad:?}: {o:?}");
        }
    }
}

#[test]
fn the_endpoint_member_is_located_not_interpreted() {
    let edge = trusted();
    let raw = r#"{"protocol_version":"0.1","message_id":"m","actions":[
        {"action_id":"a","action_type":"kv.fetch","action_version":"1.0","payload":{"a":[1,{"source_control_endpoint":"nested"}],"b":{"source_control_endpoint":"deeper"},"source_control_endpoint":"tcp:\/\/h:1","z":1}},
        {"action_id":"b","action_type":"kv.fetch","action_version":"1.0","payload":{"block_hashes":[1,2]}},
        {"action_id":"c","action_type":"other","action_version":"1","payload":{"source_control_endpoint":7}},
        {"action_id":"d","action_type":"other","action_version":"1","payload":{"h":[1,2,3],"source_control_endpoint":"last"}}
    ],"source_control_endpoint":"root-level is not an action's"}"#;
    let s = assert_admitted(outcome(&edge, raw));
    let got: Vec<Option<&[u8]>> = s.actions().map(|a| a.endpoint_value()).collect();
    assert_eq!(got, [Some(&br#""tcp://h:1""#[..]), None, Some(&b"7"[..]), Some(&br#""last""#[..])]);
    for a in s.actions() {
        assert_eq!(a.endpoint_value(), kvrelay::policy::payload_member(a.payload(), "source_control_endpoint"));
    }
    // not a 0.1 rule: a future version with such a member is still unknown_version
    assert_ignored(
        outcome(&edge, r#"{"protocol_version":"0.2","payload":{"source_control_endpoint":1}}"#),
        Reason::UnknownVersion,
    );
}

/// The test command runs this file, the property tests and the conformance suite a second time
/// with `--cfg kvrelay_portable`: this proves that run really takes the portable scanner.
#[test]
fn the_scanner_is_the_one_this_build_asked_for() {
    let want = if cfg!(kvrelay_portable) || !cfg!(target_arch = "x86_64") { "portable" } else { "sse2" };
    assert_eq!(kvrelay::hints::SCANNER, want);
}
