//! nst/JSONTestSuite `test_parsing`: every document embedded as a payload member value.
//! `y_` must be admitted unless SPEC.md rejects it (each exception names its rule), `n_` must be
//! malformed, `i_` must come back with a clean outcome and never panic.
//!
//! The corpus is vendored in `tests/data/JSONTestSuite` (MIT, see its LICENSE and README), or
//! read from where `KVRELAY_CONFORMANCE_DIR` points; its absence fails the test rather than
//! skipping it.

use std::path::PathBuf;

use kvrelay::{Admission, AdmissionConfig, Outcome, Reason};

/// `y_` documents SPEC.md rejects, with the rule.
const Y_EXCEPTIONS: &[(&str, &str)] = &[
    ("y_object_duplicated_key.json", "step 4: duplicate member names"),
    ("y_object_duplicated_key_and_value.json", "step 4: duplicate member names"),
];

/// `y_` documents whose decoded value differs from serde_json's reading, with the rule.
const DECODE_DIFFERS: &[(&str, &str)] = &[
    ("y_number_minus_zero.json", "section 3: the integer -0 is written 0 (serde_json reads -0.0)"),
    ("y_number_negative_zero.json", "section 3: the integer -0 is written 0 (serde_json reads -0.0)"),
];

fn corpus() -> PathBuf {
    let dir = std::env::var_os("KVRELAY_CONFORMANCE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/JSONTestSuite"));
    let p = dir.join("test_parsing");
    assert!(p.is_dir(), "conformance corpus not found at {} (set KVRELAY_CONFORMANCE_DIR)", p.display());
    p
}

fn embed(doc: &[u8]) -> Vec<u8> {
    let mut v = br#"{"protocol_version":"0.1","message_id":"m","actions":[{"action_id":"a","action_type":"kv.fetch","action_version":"1.0","payload":{"x":"#.to_vec();
    v.extend_from_slice(doc);
    v.extend_from_slice(b"}}]}");
    v
}

#[test]
fn json_test_suite() {
    let edge = Admission::new(AdmissionConfig { trusted: true, ..Default::default() }).unwrap();
    let mut files: Vec<_> = std::fs::read_dir(corpus()).unwrap().map(|e| e.unwrap().path()).collect();
    files.sort();
    let (mut y, mut n, mut i) = (0, 0, 0);
    let mut failures = Vec::new();
    for path in &files {
        let name = path.file_name().unwrap().to_str().unwrap().to_string();
        let doc = std::fs::read(path).unwrap();
        let embedded = embed(&doc);
        let got = std::panic::catch_unwind(|| edge.admit(Some(&embedded)));
        let Ok(got) = got else {
            failures.push(format!("{name}: panicked"));
            continue;
        };
        let admitted = matches!(got, Outcome::Admitted(_));
        let malformed = matches!(&got, Outcome::Ignored(ig) if ig.reason == Reason::Malformed);
        match name.as_bytes()[0] {
            b'y' => {
                y += 1;
                let exception = Y_EXCEPTIONS.iter().find(|(f, _)| *f == name);
                match (exception, admitted) {
                    (None, true) => {
                        // the payload value reads back as serde_json reads the document
                        let snap = got.snapshot().unwrap();
                        let x = &snap.decode()["actions"][0]["payload"]["x"];
                        let want: serde_json::Value = serde_json::from_slice(&doc).unwrap();
                        let differs = DECODE_DIFFERS.iter().any(|(f, _)| *f == name);
                        if (*x != want) != differs {
                            failures.push(format!("{name}: decoded {x}, serde_json reads {want}"));
                        }
                    }
                    (Some(_), false) if malformed => {}
                    (None, false) => failures.push(format!("{name}: y_ not admitted: {got:?}")),
                    (Some((_, rule)), _) => failures.push(format!("{name}: expected rejection ({rule}), got {got:?}")),
                }
            }
            b'n' => {
                n += 1;
                if !malformed {
                    failures.push(format!("{name}: n_ not malformed: {got:?}"));
                }
            }
            _ => {
                i += 1;
                // implementation-defined: either way is fine, but nothing else
                if !(admitted || malformed) {
                    failures.push(format!("{name}: i_ gave {got:?}"));
                }
            }
        }
    }
    assert!(y > 90 && n > 180 && i > 30, "corpus looks incomplete: y={y} n={n} i={i}");
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
    // every listed exception exists in the corpus
    for (f, _) in Y_EXCEPTIONS.iter().chain(DECODE_DIFFERS) {
        assert!(files.iter().any(|p| p.file_name().unwrap() == *f), "{f} not in corpus");
    }
}

/// SPEC.md section 3: for inputs without floats the canonical bytes equal Python's
/// `json.dumps(json.loads(x), separators=(",", ":"), ensure_ascii=False)`. Checked over every
/// admitted corpus document, embedded, in one Python process.
#[test]
fn canonical_bytes_equal_python_json_dumps() {
    let edge = Admission::new(AdmissionConfig { trusted: true, ..Default::default() }).unwrap();
    let mut inputs = Vec::new();
    let mut ours = Vec::new();
    let mut files: Vec<_> = std::fs::read_dir(corpus()).unwrap().map(|e| e.unwrap().path()).collect();
    files.sort();
    for path in files {
        let embedded = embed(&std::fs::read(&path).unwrap());
        if let Outcome::Admitted(s) = edge.admit(Some(&embedded)) {
            inputs.push(embedded);
            ours.push(s.canonical().to_vec());
        }
    }
    let script = r#"
import json, sys
docs = json.load(sys.stdin)
def has_float(v):
    if isinstance(v, float): return True
    if isinstance(v, list): return any(has_float(x) for x in v)
    if isinstance(v, dict): return any(has_float(x) for x in v.values())
    return False
out = []
for d in docs:
    v = json.loads(bytes(d).decode("utf-8"))
    out.append(None if has_float(v) else list(json.dumps(v, separators=(",", ":"), ensure_ascii=False).encode("utf-8")))
json.dump(out, sys.stdout)
"#;
    let mut child = std::process::Command::new("python3")
        .args(["-c", script])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("python3 is on every machine of this kind");
    let payload = serde_json::to_vec(&inputs).unwrap();
    use std::io::Write;
    child.stdin.take().unwrap().write_all(&payload).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    let theirs: Vec<Option<Vec<u8>>> = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(theirs.len(), ours.len());
    let mut compared = 0;
    for (i, t) in theirs.iter().enumerate() {
        if let Some(t) = t {
            compared += 1;
            assert_eq!(String::from_utf8_lossy(t), String::from_utf8_lossy(&ours[i]), "document {i}");
        }
    }
    assert!(compared > 60, "only {compared} documents compared");
}
