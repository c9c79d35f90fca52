//! CLIP tokenization and chunking against open_clip / transformers reference ids
//! (fixtures from `scripts/fixtures/make_text_fixtures.py`).

use sd_pipeline::prompt::PromptPart;
use sd_pipeline::tokenizer::{
    eos_index, zero_after_eos, ClipTokenizer, Padding, BOS_TOKEN, CHUNK_LEN, EOS_TOKEN,
    TOKENS_PER_CHUNK,
};
use serde_json::Value;

struct Case {
    prompt: String,
    ids: Vec<i32>,
    hf_77: Vec<i32>,
    open_clip_77: Option<Vec<i32>>,
}

fn ids(v: &Value) -> Vec<i32> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_i64().expect("int") as i32)
        .collect()
}

fn cases() -> Vec<Case> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/text/clip_tokens.json"
    );
    let text = std::fs::read_to_string(path).expect("fixture");
    let v: Value = serde_json::from_str(&text).expect("json");
    v["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .map(|c| Case {
            prompt: c["prompt"].as_str().expect("prompt").to_string(),
            ids: ids(&c["ids"]),
            hf_77: ids(&c["hf_77"]),
            open_clip_77: c.get("open_clip_77").map(ids),
        })
        .collect()
}

#[test]
fn bpe_ids_match_reference() {
    let tok = ClipTokenizer::sd1();
    let cases = cases();
    assert!(cases.len() >= 20);
    for c in &cases {
        assert_eq!(tok.encode(&c.prompt), c.ids, "prompt {:?}", c.prompt);
    }
}

#[test]
fn padded_chunks_match_reference() {
    let sd1 = ClipTokenizer::sd1();
    let sd2 = ClipTokenizer::sd2();
    for c in &cases() {
        let t1 = sd1.tokenize(&c.prompt);
        let t2 = sd2.tokenize(&c.prompt);
        assert_eq!(
            t1.num_chunks(),
            c.ids.len().div_ceil(TOKENS_PER_CHUNK).max(1)
        );
        // transformers truncates to one chunk: our first chunk is that.
        let (first, _) = t1.chunks().next().expect("one chunk");
        assert_eq!(first, c.hf_77.as_slice(), "prompt {:?}", c.prompt);
        if let Some(oc) = &c.open_clip_77 {
            if c.ids.len() <= TOKENS_PER_CHUNK {
                assert_eq!(t2.tokens(), oc.as_slice(), "prompt {:?}", c.prompt);
            }
        }
        assert!(t1.is_unweighted());
    }
}

#[test]
fn long_prompt_is_split_into_chunks() {
    let tok = ClipTokenizer::sd1();
    let long = cases()
        .into_iter()
        .find(|c| c.ids.len() > TOKENS_PER_CHUNK)
        .expect("a long prompt in the fixtures");
    let t = tok.tokenize_weighted(&long.prompt);
    let n = long.ids.len().div_ceil(TOKENS_PER_CHUNK);
    assert!(n >= 2);
    assert_eq!(t.num_chunks(), n);
    assert_eq!(t.tokens().len(), n * CHUNK_LEN);
    for (i, (chunk, weights)) in t.chunks().enumerate() {
        let body =
            &long.ids[i * TOKENS_PER_CHUNK..((i + 1) * TOKENS_PER_CHUNK).min(long.ids.len())];
        let mut expected = vec![BOS_TOKEN];
        expected.extend_from_slice(body);
        expected.push(EOS_TOKEN);
        expected.resize(CHUNK_LEN, EOS_TOKEN);
        assert_eq!(chunk, expected.as_slice(), "chunk {i}");
        assert!(weights.iter().all(|&w| w == 1.0));
    }
}

#[test]
fn chunk_boundaries() {
    let tok = ClipTokenizer::sd1();
    // "cat" is one token.
    assert_eq!(tok.encode("cat").len(), 1);
    let p75 = vec!["cat"; 75].join(" ");
    let p76 = vec!["cat"; 76].join(" ");
    assert_eq!(tok.tokenize(&p75).num_chunks(), 1);
    let t = tok.tokenize(&p76);
    assert_eq!(t.num_chunks(), 2);
    let (second, _) = t.chunks().nth(1).expect("second chunk");
    assert_eq!(&second[..3], &[BOS_TOKEN, tok.encode("cat")[0], EOS_TOKEN]);
    assert_eq!(tok.tokenize("").num_chunks(), 1);
}

#[test]
fn sd2_pads_with_zero() {
    let tok = ClipTokenizer::sd2();
    assert_eq!(tok.padding(), Padding::Zero);
    let t = tok.tokenize("a cat");
    let c = tok.encode("a cat");
    assert_eq!(&t.tokens()[..4], &[BOS_TOKEN, c[0], c[1], EOS_TOKEN]);
    assert!(t.tokens()[4..].iter().all(|&x| x == 0));
    assert_eq!(t.pad_token(), 0);
}

#[test]
fn weights_are_aligned_with_tokens() {
    let tok = ClipTokenizer::sd1();
    let t = tok.tokenize_weighted("a (red cat:1.5) on [a mat]");
    let a = tok.encode("a");
    let red_cat = tok.encode("red cat");
    let on = tok.encode(" on ");
    let mat = tok.encode("a mat");
    let mut expected_tokens = vec![BOS_TOKEN];
    let mut expected_weights = vec![1.0f32];
    for (ids, w) in [
        (&a, 1.0f32),
        (&red_cat, 1.5),
        (&on, 1.0),
        (&mat, (1.0 / 1.1f64) as f32),
    ] {
        expected_tokens.extend_from_slice(ids);
        expected_weights.extend(std::iter::repeat_n(w, ids.len()));
    }
    expected_tokens.push(EOS_TOKEN);
    expected_weights.push(1.0);
    let n = expected_tokens.len();
    assert_eq!(&t.tokens()[..n], expected_tokens.as_slice());
    assert_eq!(&t.weights()[..n], expected_weights.as_slice());
    assert!(t.weights()[n..].iter().all(|&w| w == 1.0));
    assert!(!t.is_unweighted());
}

#[test]
fn break_pads_to_a_new_chunk() {
    let tok = ClipTokenizer::sd2();
    let t = tok.tokenize_weighted("a cat BREAK a dog");
    assert_eq!(t.num_chunks(), 2);
    let chunks: Vec<_> = t.chunks().map(|(c, _)| c.to_vec()).collect();
    let cat = tok.encode("a cat");
    let dog = tok.encode("a dog");
    // BREAK pads the running list with EOS (not the SD2 pad token), as stable-diffusion.cpp.
    let mut first = vec![BOS_TOKEN];
    first.extend_from_slice(&cat);
    first.resize(CHUNK_LEN, EOS_TOKEN);
    assert_eq!(chunks[0], first);
    let mut second = vec![BOS_TOKEN];
    second.extend_from_slice(&dog);
    second.push(EOS_TOKEN);
    second.resize(CHUNK_LEN, 0);
    assert_eq!(chunks[1], second);
    // A BREAK at the start or on a chunk boundary adds nothing.
    assert_eq!(tok.tokenize_weighted("BREAK a cat").num_chunks(), 1);
    assert_eq!(
        tok.tokenize_parts(&[PromptPart::Break, PromptPart::Break])
            .num_chunks(),
        1
    );
}

#[test]
fn special_token_literals() {
    let tok = ClipTokenizer::sd1();
    let ids = tok.encode("a cat<|endoftext|>a dog");
    assert!(ids.contains(&EOS_TOKEN));
    assert!(tok.encode("<|startoftext|>").contains(&BOS_TOKEN));
    assert!(!tok.encode("<start_of_text>").contains(&BOS_TOKEN));
}

#[test]
fn decode_round_trip() {
    let tok = ClipTokenizer::sd1();
    let ids = tok.encode("Hello world!!!");
    assert_eq!(tok.decode(&ids), "hello world !!! ");
    assert_eq!(
        tok.decode(&[BOS_TOKEN, -5, 1_000_000, EOS_TOKEN]),
        "<|startoftext|><|endoftext|>"
    );
}

#[test]
fn sdxl_helpers() {
    let tok = ClipTokenizer::sd1();
    let t = tok.tokenize("a cat");
    let (chunk, _) = t.chunks().next().expect("chunk");
    let g = zero_after_eos(chunk);
    assert_eq!(eos_index(chunk), 3);
    assert_eq!(&g[..4], &chunk[..4]);
    assert!(g[4..].iter().all(|&x| x == 0));
    assert_eq!(eos_index(&[1, 2, 3]), 2);
    assert_eq!(eos_index(&[]), 0);
}
