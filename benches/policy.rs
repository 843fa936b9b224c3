//! Policy benchmark (`cargo bench --bench policy`): candidate collection plus orchestration
//! of an admitted envelope, against the admission of the same envelope measured in the same
//! run (target: under 10% of it).
//!
//! Orchestration here takes the full named-fetch path with a provider that accepts without
//! doing anything: first candidate, binding resolution, endpoint lookup in the payload,
//! normalization, registry check, one-action envelope view, provider validate + fetch.
//! Envelopes as in the admission bench; "endpoint last" puts `source_control_endpoint` after
//! the hash array, so the payload walk has to skip the whole array.

mod common;

use std::hint::black_box;
use std::sync::Arc;

use common::{envelope, measure, Rng};
use kvrelay::hints::Scratch;
use kvrelay::policy::*;
use kvrelay::{Admission, AdmissionConfig, Outcome, Snapshot};

struct Accept;
impl Provider for Accept {
    fn validate(&self, _: &FetchRequest<'_>) -> Result<(), ProviderError> {
        Ok(())
    }
    fn fetch(&self, _: &FetchRequest<'_>) -> Result<(), ProviderError> {
        Ok(())
    }
}

fn main() {
    let edge = Admission::new(AdmissionConfig { trusted: true, ..Default::default() }).unwrap();
    let mut rng = Rng(0x5EED_1234_ABCD_0001);
    let pool: Vec<u64> = (0..8192).map(|_| rng.next()).collect();
    let max_n = common::max_hashes(&pool, 65_536);
    let endpoint_last = |hashes: &[u64]| {
        envelope(hashes, false)
            .replace(r#""source_control_endpoint":"tcp://10.0.0.7:23280","#, "")
            .replace("]}}]}", r#"],"source_control_endpoint":"tcp://10.0.0.7:23280"}}]}"#)
    };
    let cases = [
        ("small (2 hashes)".to_string(), envelope(&pool[4000..4002], false)),
        (format!("max ({max_n} hashes)"), envelope(&pool[..max_n], false)),
        (format!("max, endpoint last ({max_n} hashes)"), endpoint_last(&pool[..max_n])),
    ];
    let caps = Arc::new(Capabilities::builder().support("nixl", "kv.fetch", "1.0").build().unwrap());
    let config = PolicyConfig {
        bindings: vec![BindingSpec {
            id: "nixl-0".into(),
            family: "nixl".into(),
            addressing: Addressing::Named,
            supports: vec![("kv.fetch".into(), "1.0".into())],
            authorized: true,
        }],
        endpoints: vec!["tcp://10.0.0.7:23280".into()],
        ..Default::default()
    };
    let orch = Orchestrator::new(caps.clone(), config, Box::new(Accept)).unwrap();
    let req = RequestInfo { generation_only: true, lora_adapter: false };
    let mut sc = Scratch::with_limits(65_536, 128);
    let mut list = Vec::with_capacity(16);
    println!("| envelope | admission | candidates | orchestration | both | share of admission |");
    println!("|---|---|---|---|---|---|");
    for (name, raw) in &cases {
        let raw = raw.as_bytes();
        let snap: Snapshot = match edge.admit(Some(raw)) {
            Outcome::Admitted(s) => s,
            o => panic!("{name}: {o:?}"),
        };
        assert!(matches!(orch.decide(&req, Some(&snap)), Decision::NamedFetch { .. }), "{name} must reach named fetch");
        let admit = measure(|| {
            black_box(edge.admit_with(&mut sc, Some(black_box(raw))));
        });
        let cands = measure(|| {
            black_box(collect_candidates_into(black_box(&snap), &caps, &mut list));
        });
        let decide = measure(|| {
            black_box(orch.decide(&req, Some(black_box(&snap))));
        });
        let ns = |v: f64| if v < 10_000.0 { format!("{v:.0} ns") } else { format!("{:.1} us", v / 1000.0) };
        println!(
            "| {name} | {} | {} | {} | {} | {:.2}% |",
            ns(admit),
            ns(cands),
            ns(decide),
            ns(cands + decide),
            100.0 * (cands + decide) / admit
        );
    }
}
