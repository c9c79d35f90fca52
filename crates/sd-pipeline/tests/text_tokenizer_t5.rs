//! The T5 tokenizer against transformers' `T5TokenizerFast` on 50 prompts (unicode, numbers,
//! repeated spaces, special tokens written out, prompts longer than the pipelines' lengths),
//! fixtures by `scripts/fixtures/make_t5_fixtures.py`: unpadded ids, and ids padded and
//! truncated to 256 and 512 as the SD3 and FLUX pipelines ask for them; with the shipped
//! vocabulary and with the one a llama.cpp GGUF carries in its metadata.

use std::path::PathBuf;

use sd_formats::files::{FileMetadata, TensorCatalog};
use sd_pipeline::tokenizer_t5::{T5Tokenizer, T5_EOS, T5_PAD};

fn fixture(path: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(path)
}

struct Case {
    prompt: String,
    ids: Vec<i32>,
    padded: [(usize, Vec<i32>); 2],
}

fn cases() -> Vec<Case> {
    let text = std::fs::read_to_string(fixture("tests/fixtures/text/t5_tokens.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let ids = |v: &serde_json::Value| -> Vec<i32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_i64().unwrap() as i32)
            .collect()
    };
    v["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| Case {
            prompt: c["prompt"].as_str().unwrap().to_string(),
            ids: ids(&c["ids"]),
            padded: [(256, ids(&c["ids_256"])), (512, ids(&c["ids_512"]))],
        })
        .collect()
}

fn check_all(tok: &T5Tokenizer) {
    let cases = cases();
    assert_eq!(cases.len(), 50);
    let mut truncated = 0;
    for c in &cases {
        assert_eq!(tok.encode(&c.prompt).unwrap(), c.ids, "{:?}", c.prompt);
        for (len, want) in &c.padded {
            let got = tok.encode_padded(&c.prompt, *len).unwrap();
            assert_eq!(&got, want, "{:?} at {len}", c.prompt);
            truncated += usize::from(c.ids.len() > *len);
        }
    }
    assert!(
        truncated >= 4,
        "the fixtures truncate long prompts ({truncated})"
    );
}

#[test]
fn builtin_vocabulary_gives_transformers_ids() {
    let tok = T5Tokenizer::builtin().unwrap();
    assert_eq!(tok.vocab_size(), 32100);
    check_all(&tok);
}

#[test]
fn padded_ids_end_in_eos_then_pad() {
    let tok = T5Tokenizer::builtin().unwrap();
    let ids = tok.encode_padded("a photo of a cat", 16).unwrap();
    let eos = ids.iter().position(|&i| i == T5_EOS).unwrap();
    assert!(ids[eos + 1..].iter().all(|&i| i == T5_PAD));
    let long = tok.encode_padded(&"word ".repeat(100), 8).unwrap();
    assert_eq!(long.len(), 8);
    assert_eq!(long[7], T5_EOS);
    assert!(tok.encode_padded("x", 0).is_err());
}

#[test]
fn gguf_metadata_vocabulary_gives_transformers_ids() {
    let path = fixture("../sd-models/tests/fixtures/t5/t5_tiny_q8_0.gguf");
    let mut loader = TensorCatalog::new();
    loader.add_file(&path, None).unwrap();
    let FileMetadata::Gguf(header) = &loader.files()[0].metadata else {
        panic!("not a GGUF")
    };
    let tok = T5Tokenizer::from_gguf(header, &path)
        .unwrap()
        .expect("a T5 vocabulary");
    check_all(&tok);
}

#[test]
fn a_tokenizer_file_that_is_not_t5_is_refused_naming_it() {
    let dir = std::env::temp_dir().join(format!("sd-rs-t5-tok-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("tokenizer.json");
    std::fs::write(&path, "{ not json").unwrap();
    let err = T5Tokenizer::from_file(&path).unwrap_err().to_string();
    assert!(err.contains("tokenizer.json"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}
