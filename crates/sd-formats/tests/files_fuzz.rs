//! Fuzzing the readers with proptest: random bytes behind each format's magic, the real
//! fixtures mutated (bit flips, byte and word overwrites, truncation, insertion, deletion and
//! splices between fixtures), and random pickle opcode streams. A panic anywhere fails the
//! test; parsed results must satisfy the catalog's invariants. Each test prints its number of
//! executions (`cargo test --test files_fuzz -- --nocapture`).
//!
//! `SD_RS_FUZZ_CASES` sets the number of cases per test (default 2000).

#[path = "common/builders.rs"]
mod builders;

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};

use builders::*;
use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::{Config, TestRunner};
use sd_formats::files::pickle::{unpickle, GlobalPolicy, PickleOptions};
use sd_formats::files::{parse, FileFormat, ReadOptions};
use sd_formats::FileId;

const FIXTURES: &[&str] = &[
    "mixed.safetensors",
    "mixed.gguf",
    "state_dict.pt",
    "legacy.pt",
    "esrgan_like.pth",
    "lightning.ckpt",
    "nested.pt",
];

fn cases() -> u32 {
    std::env::var("SD_RS_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000)
}

#[derive(Clone, Debug)]
enum Mutation {
    Flip(Index, u8),
    Set(Index, u8),
    Word(Index, u64, u8),
    Truncate(Index),
    Insert(Index, Vec<u8>),
    Delete(Index, Index),
    Splice {
        from: Index,
        start: Index,
        len: u16,
        at: Index,
    },
}

fn interesting() -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(0u64),
        Just(1),
        Just(u64::MAX),
        Just(u64::MAX / 2 + 1),
        Just(u32::MAX as u64),
        Just(1 << 31),
        any::<u16>().prop_map(u64::from),
        any::<u64>(),
    ]
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        4 => (any::<Index>(), 0u8..8).prop_map(|(i, b)| Mutation::Flip(i, b)),
        3 => (any::<Index>(), any::<u8>()).prop_map(|(i, b)| Mutation::Set(i, b)),
        3 => (any::<Index>(), interesting(), prop_oneof![Just(1u8), Just(2), Just(4), Just(8)])
            .prop_map(|(i, v, w)| Mutation::Word(i, v, w)),
        1 => any::<Index>().prop_map(Mutation::Truncate),
        1 => (any::<Index>(), proptest::collection::vec(any::<u8>(), 1..16)).prop_map(|(i, v)| Mutation::Insert(i, v)),
        1 => (any::<Index>(), any::<Index>()).prop_map(|(i, n)| Mutation::Delete(i, n)),
        1 => (any::<Index>(), any::<Index>(), 1u16..512, any::<Index>())
            .prop_map(|(from, start, len, at)| Mutation::Splice { from, start, len, at }),
    ]
}

fn apply(mut b: Vec<u8>, muts: &[Mutation], fixtures: &[Vec<u8>]) -> Vec<u8> {
    for m in muts {
        if b.is_empty() {
            break;
        }
        match m {
            Mutation::Flip(i, bit) => {
                let i = i.index(b.len());
                b[i] ^= 1 << bit;
            }
            Mutation::Set(i, v) => {
                let i = i.index(b.len());
                b[i] = *v;
            }
            Mutation::Word(i, v, w) => {
                let i = i.index(b.len());
                let w = (*w as usize).min(b.len() - i);
                b[i..i + w].copy_from_slice(&v.to_le_bytes()[..w]);
            }
            Mutation::Truncate(i) => b.truncate(i.index(b.len())),
            Mutation::Insert(i, v) => {
                let i = i.index(b.len() + 1);
                b.splice(i..i, v.iter().copied());
            }
            Mutation::Delete(i, n) => {
                let i = i.index(b.len());
                let n = n.index(64.min(b.len() - i) + 1);
                b.drain(i..i + n);
            }
            Mutation::Splice {
                from,
                start,
                len,
                at,
            } => {
                let src = &fixtures[from.index(fixtures.len())];
                let s = start.index(src.len());
                let e = (s + *len as usize).min(src.len());
                let at = at.index(b.len());
                let end = (at + (e - s)).min(b.len());
                b.splice(at..end, src[s..e].iter().copied());
            }
        }
    }
    b
}

/// Parses and checks what a successful parse promises.
fn check(bytes: &[u8], policy: GlobalPolicy) -> bool {
    let b = bytes.to_vec();
    let opts = ReadOptions {
        pickle_globals: policy,
    };
    let Ok(p) = parse(&b, Path::new("fuzz.bin"), FileId(0), opts) else {
        return false;
    };
    let mut spans = Vec::new();
    for t in &p.tensors {
        let end = t
            .offset
            .checked_add(t.size)
            .expect("offset + size overflows");
        assert!(
            end <= bytes.len() as u64,
            "{} ends at {end} past {}",
            t.name,
            bytes.len()
        );
        assert_eq!(
            Some(t.size as usize),
            t.dtype.bytes_for(t.numel() as usize),
            "{}",
            t.name
        );
        spans.push((t.offset, end));
    }
    // PyTorch tensors may view one storage; other formats never overlap.
    if !matches!(p.format, FileFormat::TorchZip | FileFormat::TorchLegacy) {
        spans.retain(|s| s.1 > s.0);
        spans.sort();
        for w in spans.windows(2) {
            assert!(w[0].1 <= w[1].0, "overlap {:?}", w);
        }
    }
    true
}

fn runner() -> TestRunner {
    TestRunner::new(Config {
        cases: cases(),
        failure_persistence: None,
        ..Config::default()
    })
}

fn fuzz_mutations(name: &str) {
    let fixtures: Vec<Vec<u8>> = FIXTURES.iter().map(|f| fixture(f)).collect();
    let base = fixture(name);
    assert!(check(&base, GlobalPolicy::Strict), "{name} must parse");
    let (runs, ok) = (AtomicUsize::new(0), AtomicUsize::new(0));
    runner()
        .run(
            &(proptest::collection::vec(mutation(), 1..6), any::<bool>()),
            |(muts, inert)| {
                let bytes = apply(base.clone(), &muts, &fixtures);
                let policy = if inert {
                    GlobalPolicy::Inert
                } else {
                    GlobalPolicy::Strict
                };
                runs.fetch_add(1, Ordering::Relaxed);
                if check(&bytes, policy) {
                    ok.fetch_add(1, Ordering::Relaxed);
                }
                Ok(())
            },
        )
        .unwrap();
    eprintln!(
        "fuzz {name}: {} executions, {} parsed, 0 panics",
        runs.into_inner(),
        ok.into_inner()
    );
}

#[test]
fn fuzz_safetensors_mutations() {
    fuzz_mutations("mixed.safetensors");
}

#[test]
fn fuzz_gguf_mutations() {
    fuzz_mutations("mixed.gguf");
}

#[test]
fn fuzz_torch_zip_mutations() {
    fuzz_mutations("state_dict.pt");
}

#[test]
fn fuzz_torch_legacy_mutations() {
    fuzz_mutations("legacy.pt");
}

#[test]
fn fuzz_torch_nested_mutations() {
    fuzz_mutations("nested.pt");
}

#[test]
fn fuzz_random_bytes_behind_magics() {
    let magics: Vec<Vec<u8>> = vec![
        b"GGUF\x03\x00\x00\x00".to_vec(),
        b"GGUF\x02\x00\x00\x00".to_vec(),
        b"PK\x03\x04".to_vec(),
        b"\x80\x02".to_vec(),
        b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19.\x80\x02M\xe9\x03.\x80\x02}."
            .to_vec(),
        {
            let mut v = 40u64.to_le_bytes().to_vec();
            v.push(b'{');
            v
        },
        Vec::new(),
    ];
    let (runs, ok) = (AtomicUsize::new(0), AtomicUsize::new(0));
    runner()
        .run(
            &(
                any::<Index>(),
                proptest::collection::vec(any::<u8>(), 0..256),
            ),
            |(m, tail)| {
                let mut bytes = magics[m.index(magics.len())].clone();
                bytes.extend_from_slice(&tail);
                runs.fetch_add(1, Ordering::Relaxed);
                if check(&bytes, GlobalPolicy::Inert) {
                    ok.fetch_add(1, Ordering::Relaxed);
                }
                Ok(())
            },
        )
        .unwrap();
    eprintln!(
        "fuzz random bytes: {} executions, {} parsed, 0 panics",
        runs.into_inner(),
        ok.into_inner()
    );
}

/// Opcodes the VM knows (and a few it refuses), each followed by 0-9 random argument bytes.
const OPCODES: &[u8] = b"\x80\x95.()012N\x88\x89JKM\x8a\x8bGX\x8c\x8dTUBC\x8e\x96)t\x85\x86\x87]\x8fl\x91ae\x90}dsupqr\x94ghjc\x93ioR\x81\x92bQPIL\x82\x97S";

/// Globals the structured generator names.
const GLOBALS: &[(&str, &str)] = &[
    ("collections", "OrderedDict"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_parameter"),
    ("torch._tensor", "_rebuild_from_type_v2"),
    ("torch", "FloatStorage"),
    ("torch", "HalfStorage"),
    ("torch", "ByteStorage"),
    ("torch", "Size"),
    ("torch", "float16"),
    ("_codecs", "encode"),
    ("torch.nn.parameter", "Parameter"),
    ("some.module", "Thing"),
];

/// Well-formed opcodes with plausible arguments, so streams get past the first few bytes.
fn structured_op(kind: usize, n: u8, g: usize) -> Vec<u8> {
    let s = |t: &str| {
        let mut v = vec![b'X'];
        v.extend_from_slice(&(t.len() as u32).to_le_bytes());
        v.extend_from_slice(t.as_bytes());
        v
    };
    let (module, name) = GLOBALS[g % GLOBALS.len()];
    match kind % 24 {
        0 => vec![b'('],
        1 => vec![b')'],
        2 => vec![b't'],
        3 => vec![0x85 + n % 3],
        4 => vec![b'}'],
        5 => vec![b']'],
        6 => vec![b's'],
        7 => vec![b'u'],
        8 => vec![b'a'],
        9 => vec![b'e'],
        10 => vec![b'K', n],
        11 => vec![b'q', n % 8],
        12 => vec![b'h', n % 8],
        13 => vec![b'R'],
        14 => vec![b'b'],
        15 => vec![b'Q'],
        16 => [b"c".to_vec(), format!("{module}\n{name}\n").into_bytes()].concat(),
        17 => [s(module), s(name), vec![0x93]].concat(),
        18 => s(["storage", "0", "1", "cpu", "state_dict", "params_ema", "w"][n as usize % 7]),
        19 => vec![b'N'],
        20 => vec![0x89 - n % 2],
        21 => vec![b'0'],
        22 => vec![b'2'],
        _ => vec![0x81],
    }
}

#[test]
fn fuzz_pickle_opcode_streams() {
    let (runs, ok) = (AtomicUsize::new(0), AtomicUsize::new(0));
    let raw = (
        any::<Index>(),
        proptest::collection::vec(any::<u8>(), 0..10),
    )
        .prop_map(|(i, args)| {
            let mut v = vec![OPCODES[i.index(OPCODES.len())]];
            v.extend_from_slice(&args);
            v
        });
    let structured =
        (any::<usize>(), any::<u8>(), any::<usize>()).prop_map(|(k, n, g)| structured_op(k, n, g));
    let op = prop_oneof![1 => raw, 6 => structured];
    runner()
        .run(
            &(proptest::collection::vec(op, 1..64), any::<bool>()),
            |(ops, as_file)| {
                let mut p = vec![0x80, 2];
                for o in &ops {
                    p.extend_from_slice(o);
                }
                p.push(b'.');
                runs.fetch_add(1, Ordering::Relaxed);
                let good = if as_file {
                    check(
                        &legacy(&p, &["0", "1"], &[(4, &f32_ramp(4)), (2, &f32_ramp(2))]),
                        GlobalPolicy::Inert,
                    )
                } else {
                    let opts = PickleOptions {
                        globals: GlobalPolicy::Inert,
                        persistent: true,
                    };
                    unpickle(&p, Path::new("fuzz.pkl"), opts).is_ok()
                };
                if good {
                    ok.fetch_add(1, Ordering::Relaxed);
                }
                Ok(())
            },
        )
        .unwrap();
    eprintln!(
        "fuzz pickle opcodes: {} executions, {} accepted, 0 panics",
        runs.into_inner(),
        ok.into_inner()
    );
}
