//! The activation test matrix (issue: candidate collection and the orchestration policy).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use kvrelay::policy::*;
use kvrelay::{Admission, AdmissionConfig, Outcome, Snapshot};

/// Counts contacts. `validations` are provider checks; `submissions` are fetches (the only
/// place a real provider would connect).
#[derive(Default)]
struct Mock {
    validations: AtomicUsize,
    submissions: AtomicUsize,
    reject_validate: bool,
    reject_fetch: bool,
    decline_fetch: bool,
    seen: Mutex<Vec<(String, String)>>, // (binding, endpoint)
}

impl Provider for Mock {
    fn validate(&self, req: &FetchRequest<'_>) -> Result<(), ProviderError> {
        self.validations.fetch_add(1, Ordering::SeqCst);
        self.seen.lock().unwrap().push((req.binding_id.to_string(), req.endpoint.to_string()));
        if self.reject_validate {
            Err(ProviderError { code: 7 })
        } else {
            Ok(())
        }
    }
    fn fetch(&self, _req: &FetchRequest<'_>) -> Result<(), ProviderError> {
        self.submissions.fetch_add(1, Ordering::SeqCst);
        if self.reject_fetch {
            Err(ProviderError { code: 9 })
        } else if self.decline_fetch {
            Err(ProviderError { code: 11 | kvrelay::policy::PROVIDER_DECLINED })
        } else {
            Ok(())
        }
    }
}

impl Mock {
    fn contacts(&self) -> (usize, usize) {
        (self.validations.load(Ordering::SeqCst), self.submissions.load(Ordering::SeqCst))
    }
}

const EP: &str = "tcp://10.0.0.7:23280";

fn snap(actions: &[(&str, &str, &str, &str)]) -> Snapshot {
    // (id, type, version, endpoint)
    let acts: Vec<String> = actions
        .iter()
        .map(|(id, t, v, ep)| {
            format!(
                r#"{{"action_id":"{id}","action_type":"{t}","action_version":"{v}","payload":{{"block_hashes":[1,2,3],"source_control_endpoint":"{ep}"}}}}"#
            )
        })
        .collect();
    let raw = format!(r#"{{"protocol_version":"0.1","message_id":"m","actions":[{}]}}"#, acts.join(","));
    let edge = Admission::new(AdmissionConfig { trusted: true, ..Default::default() }).unwrap();
    match edge.admit(Some(raw.as_bytes())) {
        Outcome::Admitted(s) => s,
        o => panic!("{o:?}"),
    }
}

fn fetch1(ep: &str) -> Snapshot {
    snap(&[("a1", "kv.fetch", "1.0", ep)])
}

fn caps() -> Arc<Capabilities> {
    Arc::new(
        Capabilities::builder()
            .support("nixl", "kv.fetch", "1.0")
            .support("mooncake", "kv.fetch", "1.0")
            .support("mooncake", "kv.fetch", "2.0")
            .support("lmcache", "kv.prefetch", "1.0")
            .build()
            .unwrap(),
    )
}

fn binding(id: &str, family: &str, addressing: Addressing, authorized: bool, supports: &[(&str, &str)]) -> BindingSpec {
    BindingSpec {
        id: id.into(),
        family: family.into(),
        addressing,
        supports: supports.iter().map(|(t, v)| (t.to_string(), v.to_string())).collect(),
        authorized,
    }
}

fn named(id: &str, family: &str) -> BindingSpec {
    binding(id, family, Addressing::Named, true, &[("kv.fetch", "1.0")])
}

fn orch(bindings: Vec<BindingSpec>, endpoints: &[&str], mock: &Arc<Mock>) -> Orchestrator {
    let config =
        PolicyConfig { bindings, endpoints: endpoints.iter().map(|s| s.to_string()).collect(), ..Default::default() };
    Orchestrator::new(caps(), config, Box::new(mock.clone())).unwrap()
}

const GEN: RequestInfo = RequestInfo { generation_only: true, lora_adapter: false };

// ---- starred: registry and provider checks each block an unauthorized destination ----

#[test]
fn runtime_registry_blocks_unauthorized_destination_when_provider_validation_is_bypassed() {
    let mock = Arc::new(Mock::default()); // accepts everything: provider validation bypassed
    let o = orch(vec![named("b", "nixl")], &["tcp://10.0.0.8:23280"], &mock);
    let d = o.decide(&GEN, Some(&fetch1("tcp://evil.example:23280")));
    assert_eq!(d.discard(), Some(Discard::EndpointNotTrusted));
    assert_eq!(mock.contacts(), (0, 0), "no validation, connection or submission");
}

#[test]
fn provider_check_blocks_unauthorized_destination_when_runtime_check_is_bypassed() {
    let mock = Arc::new(Mock { reject_validate: true, ..Default::default() });
    // the registry lists the destination: the runtime check passes (bypassed)
    let o = orch(vec![named("b", "nixl")], &["tcp://evil.example:23280"], &mock);
    let d = o.decide(&GEN, Some(&fetch1("tcp://EVIL.example:23280")));
    assert_eq!(d.discard(), Some(Discard::ProviderRejected));
    assert_eq!(mock.contacts(), (1, 0), "validated once, never connected or submitted");
    assert_eq!(mock.seen.lock().unwrap()[0].1, "tcp://evil.example:23280", "the provider sees the normalized endpoint");
}

#[test]
fn request_paired_binding_is_rejected_before_any_lookup_connection_or_submission() {
    let mock = Arc::new(Mock::default());
    let o = orch(vec![binding("pd", "nixl", Addressing::RequestPaired, true, &[("kv.fetch", "1.0")])], &[EP], &mock);
    // P/D handoff parameters belong to the request; decide() only reads eligibility facts
    let handoff = (String::from("prefill-7"), 4242u64);
    let before = handoff.clone();
    // an endpoint that would fail the registry proves the lookup never happened
    for ep in [EP, "not an endpoint"] {
        assert_eq!(o.decide(&GEN, Some(&fetch1(ep))).discard(), Some(Discard::RequestPaired));
    }
    assert_eq!(mock.contacts(), (0, 0));
    assert_eq!(handoff, before);
}

#[test]
fn lora_requests_skip_candidate_collection_and_contact_nothing() {
    let mock = Arc::new(Mock::default());
    let o = orch(vec![named("b", "nixl")], &[EP], &mock);
    let lora = RequestInfo { generation_only: true, lora_adapter: true };
    assert_eq!(o.decide(&lora, Some(&fetch1(EP))).discard(), Some(Discard::LoraAdapter));
    // an unsupported hint still reports the eligibility reason: collection never ran
    let unsupported = snap(&[("a1", "kv.other", "1.0", EP)]);
    assert_eq!(o.decide(&lora, Some(&unsupported)).discard(), Some(Discard::LoraAdapter));
    assert_eq!(mock.contacts(), (0, 0));
    // eligible requests without LoRA still reach candidate collection
    assert_eq!(o.decide(&GEN, Some(&unsupported)).discard(), Some(Discard::NoCandidate));
    assert!(matches!(o.decide(&GEN, Some(&fetch1(EP))), Decision::NamedFetch { .. }));
    assert_eq!(mock.contacts(), (1, 1));
}

// ---- generation-only requests with and without a usable hint ----

#[test]
fn usable_hint_attempts_named_fetch_before_the_paired_source() {
    let mock = Arc::new(Mock::default());
    let o = orch(vec![named("b", "nixl")], &[EP], &mock);
    let s = fetch1("TCP://10.0.0.7:023280");
    match o.decide(&GEN, Some(&s)) {
        Decision::NamedFetch { binding, envelope } => {
            assert_eq!(&*binding, "b");
            assert!(Snapshot::ptr_eq(envelope.snapshot(), &s), "the envelope shares the snapshot");
            assert_eq!(envelope.action().id(), "a1");
        }
        d => panic!("{d:?}"),
    }
    assert_eq!(mock.contacts(), (1, 1));
    assert_eq!(o.counters().named_fetch, 1);
}

#[test]
fn absent_discarded_unsupported_excluded_and_unresolved_keep_the_paired_path() {
    let mock = Arc::new(Mock::default());
    let o = orch(vec![named("b", "nixl")], &[EP], &mock);
    let cases: Vec<(RequestInfo, Option<Snapshot>, Discard)> = vec![
        (GEN, None, Discard::NoHint),
        (GEN, Some(snap(&[("a", "kv.fetch", "9.9", EP)])), Discard::NoCandidate),
        (GEN, Some(snap(&[("a", "kv.teleport", "1.0", EP)])), Discard::NoCandidate),
        (RequestInfo { generation_only: false, lora_adapter: false }, Some(fetch1(EP)), Discard::NotGenerationOnly),
        (GEN, Some(snap(&[("a", "kv.fetch", "2.0", EP)])), Discard::MissingMapping), // only mooncake, no binding
    ];
    for (req, s, want) in cases {
        assert_eq!(o.decide(&req, s.as_ref()).discard(), Some(want));
    }
    assert_eq!(mock.contacts(), (0, 0), "no named-fetch work");
    let c = o.counters();
    assert_eq!(c.discarded(Discard::NoCandidate), 2);
    assert_eq!(c.discarded(Discard::MissingMapping), 1);
}

#[test]
fn every_discard_reason_is_distinct_and_exposed() {
    let names: std::collections::HashSet<_> = Discard::ALL.iter().map(|d| d.as_str()).collect();
    assert_eq!(names.len(), Discard::ALL.len());
    let mock = Arc::new(Mock::default());
    let o = orch(vec![named("b", "nixl")], &[EP], &mock);
    o.decide(&GEN, None);
    let text = o.prometheus();
    assert!(text.contains("# TYPE kvrelay_kv_policy_discarded_total counter\n"));
    assert!(text.contains("kvrelay_kv_policy_discarded_total{reason=\"no_hint\"} 1\n"));
    assert!(text.contains("kvrelay_kv_policy_named_fetch_total 0\n"));
    for d in Discard::ALL {
        assert!(text.contains(&format!("{{reason=\"{}\"}}", d.as_str())));
    }
}

// ---- resolution ----

fn both_orders(bindings: Vec<BindingSpec>, want: Result<&str, Discard>) {
    for order in [bindings.clone(), bindings.into_iter().rev().collect()] {
        let mock = Arc::new(Mock::default());
        let o = orch(order, &[EP], &mock);
        match (o.decide(&GEN, Some(&fetch1(EP))), want) {
            (Decision::NamedFetch { binding, .. }, Ok(id)) => assert_eq!(&*binding, id),
            (Decision::KeepPairedPath(d), Err(w)) => {
                assert_eq!(d, w);
                assert_eq!(mock.contacts(), (0, 0));
            }
            (d, w) => panic!("{d:?} vs {w:?}"),
        }
    }
}

#[test]
fn overlapping_families_resolve_the_one_authorized_binding_in_either_order() {
    // kv.fetch 1.0 is supported by nixl and mooncake
    both_orders(
        vec![named("n", "nixl"), binding("m", "mooncake", Addressing::Named, false, &[("kv.fetch", "1.0")])],
        Ok("n"),
    );
}

#[test]
fn several_bindings_in_one_family_resolve_the_supported_authorized_one_in_either_order() {
    both_orders(
        vec![
            binding("old", "nixl", Addressing::Named, true, &[("kv.fetch", "0.9")]),
            named("new", "nixl"),
            binding("off", "nixl", Addressing::Named, false, &[("kv.fetch", "1.0")]),
        ],
        Ok("new"),
    );
}

#[test]
fn missing_unauthorized_mismatched_and_ambiguous_mappings_are_rejected() {
    both_orders(vec![named("p", "lmcache")], Err(Discard::MissingMapping));
    both_orders(
        vec![binding("x", "nixl", Addressing::Named, false, &[("kv.fetch", "1.0")])],
        Err(Discard::Unauthorized),
    );
    both_orders(
        vec![binding("x", "nixl", Addressing::Named, true, &[("kv.fetch", "3.0")])],
        Err(Discard::CapabilityMismatch),
    );
    both_orders(vec![named("n", "nixl"), named("m", "mooncake")], Err(Discard::AmbiguousMapping));
    both_orders(vec![named("n1", "nixl"), named("n2", "nixl")], Err(Discard::AmbiguousMapping));
}

#[test]
fn rejection_never_selects_another_candidate_family_or_binding() {
    let good = "tcp://10.0.0.7:23280";
    // the first candidate is only mapped through an unauthorized binding; the second would work
    let two = snap(&[("first", "kv.fetch", "2.0", good), ("second", "kv.fetch", "1.0", good)]);
    let mock = Arc::new(Mock::default());
    let o = orch(
        vec![binding("m", "mooncake", Addressing::Named, false, &[("kv.fetch", "2.0")]), named("n", "nixl")],
        &[good],
        &mock,
    );
    assert_eq!(o.decide(&GEN, Some(&two)).discard(), Some(Discard::Unauthorized));
    assert_eq!(mock.contacts(), (0, 0));
    // payload rejection of the first candidate
    let bad_first = snap(&[("first", "kv.fetch", "1.0", "tcp://*:1"), ("second", "kv.fetch", "1.0", good)]);
    let o = orch(vec![named("n", "nixl")], &[good], &mock);
    assert_eq!(o.decide(&GEN, Some(&bad_first)).discard(), Some(Discard::EndpointInvalid));
    assert_eq!(mock.contacts(), (0, 0));
    // provider rejection: validated exactly once, nothing else tried
    let picky = Arc::new(Mock { reject_validate: true, ..Default::default() });
    let o = orch(vec![named("n", "nixl")], &[good], &picky);
    let both_good = snap(&[("first", "kv.fetch", "1.0", good), ("second", "kv.fetch", "1.0", good)]);
    assert_eq!(o.decide(&GEN, Some(&both_good)).discard(), Some(Discard::ProviderRejected));
    assert_eq!(picky.contacts(), (1, 0));
    // a failed submission is not retried elsewhere either
    let flaky = Arc::new(Mock { reject_fetch: true, ..Default::default() });
    let o = orch(vec![named("n", "nixl")], &[good], &flaky);
    assert_eq!(o.decide(&GEN, Some(&both_good)).discard(), Some(Discard::FetchFailed));
    assert_eq!(flaky.contacts(), (1, 1));
    // a provider that declines by choice (its code marked) is a decline, not a failed fetch,
    // and counted apart; its whole code is the answer
    let choosy = Arc::new(Mock { decline_fetch: true, ..Default::default() });
    let o = orch(vec![named("n", "nixl")], &[good], &choosy);
    let (d, answer) = o.decide_with_answer(&GEN, Some(&both_good));
    assert_eq!(d.discard(), Some(Discard::ProviderDeclined));
    assert_eq!(answer.map(|a| a.code), Some(11 | kvrelay::policy::PROVIDER_DECLINED));
    assert_eq!(choosy.contacts(), (1, 1));
    let c = o.counters();
    assert_eq!(
        (c.discarded[Discard::ProviderDeclined as usize], c.discarded[Discard::FetchFailed as usize]),
        (1, 0),
        "{c:?}"
    );
}

#[test]
fn endpoint_problems_have_their_own_reasons() {
    let mock = Arc::new(Mock::default());
    let o = orch(vec![named("n", "nixl")], &[EP], &mock);
    let no_ep = {
        let raw = r#"{"protocol_version":"0.1","message_id":"m","actions":[{"action_id":"a","action_type":"kv.fetch","action_version":"1.0","payload":{"block_hashes":[1],"source_control_endpoint":7}}]}"#;
        Admission::new(AdmissionConfig { trusted: true, ..Default::default() }).unwrap().admit(Some(raw.as_bytes()))
    };
    assert_eq!(o.decide(&GEN, no_ep.snapshot()).discard(), Some(Discard::EndpointMissing));
    assert_eq!(o.decide(&GEN, Some(&fetch1("tcp://10.0.0.7"))).discard(), Some(Discard::EndpointInvalid));
    assert_eq!(o.decide(&GEN, Some(&fetch1("tcp://10.0.0.7:23281"))).discard(), Some(Discard::EndpointNotTrusted));
    // the same untrusted address in other spellings: one reason, whatever the spelling (a
    // numeric spelling with leading zeros or as one number is never in a registry)
    for spelling in ["tcp://010.0.0.7:23281", "tcp://10.0.0.07:23281", "tcp://167772167:23281", "TCP://10.0.0.7:023281"]
    {
        assert_eq!(o.decide(&GEN, Some(&fetch1(spelling))).discard(), Some(Discard::EndpointNotTrusted), "{spelling}");
    }
    assert_eq!(mock.contacts(), (0, 0));
}

// ---- candidate collection ----

#[test]
fn candidate_collection_order_families_repeats_and_counts() {
    let c = caps();
    let s = snap(&[
        ("u", "kv.unrelated", "1.0", EP), // unknown type, before a kv.fetch: does not suppress it
        ("a", "kv.fetch", "1.0", EP),     // nixl and mooncake
        ("a", "kv.fetch", "2.0", EP),     // repeated id, mooncake only
        ("v", "kv.fetch", "7.0", EP),     // version no family supports
        ("p", "kv.prefetch", "1.0", EP),  // known type, not kv.fetch: neither candidate nor counted
        ("u", "kv.unrelated", "2.0", EP), // unknown type again
    ]);
    let cands = collect_candidates(&s, &c);
    let list = cands.list();
    assert_eq!(list.iter().map(|x| x.action_index).collect::<Vec<_>>(), [1, 2], "producer order");
    let (nixl, moon) = (c.family("nixl").unwrap(), c.family("mooncake").unwrap());
    assert!(list[0].families.contains(nixl) && list[0].families.contains(moon) && list[0].families.len() == 2);
    assert!(!list[1].families.contains(nixl) && list[1].families.contains(moon));
    assert_eq!(cands.action(&list[1]).id(), "a", "repeated action ids kept");
    assert!(Snapshot::ptr_eq(cands.snapshot(), &s));
    // each counted once, however many families exist
    assert_eq!(cands.counts(), CandidateCounts { unknown_type: 2, no_matching_version: 1 });
    // first_candidate agrees
    assert_eq!(first_candidate(&s, &c), Some(list[0]));
}

#[test]
fn empty_capabilities_or_no_match_give_no_candidates() {
    let s = fetch1(EP);
    let empty = Capabilities::builder().build().unwrap();
    let cands = collect_candidates(&s, &empty);
    assert!(cands.list().is_empty());
    assert_eq!(cands.counts().unknown_type, 1);
    let other = Capabilities::builder().support("x", "kv.fetch", "5").build().unwrap();
    let cands = collect_candidates(&s, &other);
    assert!(cands.list().is_empty());
    assert_eq!(cands.counts(), CandidateCounts { unknown_type: 0, no_matching_version: 1 });
    let mut reuse = Vec::with_capacity(4);
    collect_candidates_into(&s, &caps(), &mut reuse);
    assert_eq!(reuse.len(), 1);
}

#[test]
fn endpoint_normalization() {
    let ok = [
        ("tcp://127.0.0.1:23280", "tcp://127.0.0.1:23280"),
        ("TCP://Host.Example:080", "tcp://host.example:80"),
        ("tcp://[0:0::1]:5", "tcp://[::1]:5"),
        ("tcp://[FE80::1]:65535", "tcp://[fe80::1]:65535"),
    ];
    for (i, o) in ok {
        assert_eq!(normalize_endpoint(i).as_deref(), Ok(o), "{i}");
    }
    let bad = [
        ("127.0.0.1:1", EndpointError::Scheme),
        ("tcp://127.0.0.1", EndpointError::Port),
        ("tcp://127.0.0.1:0", EndpointError::Port),
        ("tcp://127.0.0.1:65536", EndpointError::Port),
        ("tcp://h:+1", EndpointError::Port),
        ("tcp://*:1", EndpointError::Wildcard),
        ("tcp://0.0.0.0:1", EndpointError::Wildcard),
        ("tcp://[::]:1", EndpointError::Wildcard),
        ("tcp://::1:5", EndpointError::Host),
        ("tcp://[::1]5", EndpointError::Port),
        ("tcp://user@h:1", EndpointError::Extra),
        ("tcp://h:1/path", EndpointError::Extra),
        ("tcp://h..x:1", EndpointError::Host),
        ("tcp://010.0.0.1:1", EndpointError::Ambiguous),
        ("tcp://[fe80::1%eth0]:1", EndpointError::Extra),
        ("1tcp://h:1", EndpointError::Scheme),
    ];
    for (i, e) in bad {
        assert_eq!(normalize_endpoint(i), Err(e), "{i}");
    }
}

#[test]
fn policy_config_is_checked() {
    let mock = Arc::new(Mock::default());
    let build = |b: Vec<BindingSpec>, e: &[&str]| {
        Orchestrator::new(
            caps(),
            PolicyConfig { bindings: b, endpoints: e.iter().map(|s| s.to_string()).collect(), ..Default::default() },
            Box::new(mock.clone()),
        )
        .map(|_| ())
    };
    assert_eq!(build(vec![named("x", "nope")], &[]), Err(PolicyError::UnknownFamily("x".into())));
    assert_eq!(
        build(vec![named("x", "nixl"), named("x", "mooncake")], &[]),
        Err(PolicyError::DuplicateBinding("x".into()))
    );
    assert!(matches!(build(vec![], &["tcp://*:1"]), Err(PolicyError::Endpoint(_, EndpointError::Wildcard))));
    assert_eq!(build(vec![named("x", "nixl")], &[EP]), Ok(()));
    assert_eq!(Capabilities::builder().support("", "kv.fetch", "1").build().unwrap_err(), CapabilitiesError::Empty);
    let mut b = Capabilities::builder();
    for i in 0..65 {
        b.add(&format!("f{i}"), "kv.fetch", "1");
    }
    assert_eq!(b.build().unwrap_err(), CapabilitiesError::TooManyFamilies);
}

#[test]
fn orchestration_accounts_unknown_type_and_no_matching_version_once_per_request() {
    let mock = Arc::new(Mock::default());
    let o = orch(vec![named("b1", "nixl")], &[EP], &mock);
    // one unknown type, one kv.fetch of an unsupported version, then a usable candidate
    let s = snap(&[("a1", "kv.other", "1.0", EP), ("a2", "kv.fetch", "9.9", EP), ("a3", "kv.fetch", "1.0", EP)]);
    assert!(matches!(o.decide(&GEN, Some(&s)), Decision::NamedFetch { .. }));
    assert!(matches!(o.decide(&GEN, Some(&s)), Decision::NamedFetch { .. }));
    // ineligible requests never reach candidate collection: nothing counted
    o.decide(&RequestInfo { generation_only: true, lora_adapter: true }, Some(&s));
    let v = o.counters();
    assert_eq!((v.unknown_type, v.no_matching_version), (2, 2));
    let text = o.prometheus();
    assert!(text.contains("kvrelay_kv_policy_unknown_type_total 2\n"), "{text}");
    assert!(text.contains("kvrelay_kv_policy_no_matching_version_total 2\n"), "{text}");
}
