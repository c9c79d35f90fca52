//! The Qwen2 tokenizer against transformers' `Qwen2TokenizerFast` (built from a `vocab.json` /
//! `merges.txt` written from the merges sd-rs ships) on 50 prompts (unicode, CJK, digits,
//! punctuation, newlines, contractions, special tokens written out, long prompts), fixtures by
//! `scripts/fixtures/make_llm_fixtures.py tokenizer`: plain ids, and the ids of the prompt in
//! Qwen-Image's template truncated as diffusers' `QwenImagePipeline` does, with the 34-token
//! drop count.

use std::path::PathBuf;

use sd_pipeline::tokenizer_qwen::{
    QwenTokenizer, QWEN2_ENDOFTEXT, QWEN2_IM_END, QWEN2_IM_START, QWEN_IMAGE_TEMPLATE,
};

fn fixture(path: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(path)
}

struct Case {
    prompt: String,
    ids: Vec<i32>,
    template_ids: Vec<i32>,
}

fn fixtures() -> (usize, Vec<Case>) {
    let text = std::fs::read_to_string(fixture("tests/fixtures/text/qwen_tokens.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let ids = |v: &serde_json::Value| -> Vec<i32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_i64().unwrap() as i32)
            .collect()
    };
    let cases = v["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| Case {
            prompt: c["prompt"].as_str().unwrap().to_string(),
            ids: ids(&c["ids"]),
            template_ids: ids(&c["template_ids"]),
        })
        .collect();
    (v["template_drop"].as_u64().unwrap() as usize, cases)
}

#[test]
fn qwen_tokenizer_matches_transformers_on_50_prompts() {
    let tok = QwenTokenizer::builtin().unwrap();
    assert_eq!(tok.vocab_size(), 151_669);
    let (drop, cases) = fixtures();
    assert_eq!(cases.len(), 50);
    assert_eq!(drop, 34);
    let mut truncated = 0;
    for c in &cases {
        assert_eq!(tok.encode(&c.prompt).unwrap(), c.ids, "{:?}", c.prompt);
        let t = tok.encode_qwen_image(&c.prompt).unwrap();
        assert_eq!(t.ids, c.template_ids, "template of {:?}", c.prompt);
        assert_eq!(t.drop, drop, "{:?}", c.prompt);
        truncated += usize::from(c.ids.len() > 1024);
    }
    assert!(truncated >= 1, "the fixtures truncate a long prompt");
}

#[test]
fn the_qwen_image_template_prefix_is_34_tokens_of_known_ids() {
    let tok = QwenTokenizer::builtin().unwrap();
    let prefix = tok.encode(QWEN_IMAGE_TEMPLATE.prefix).unwrap();
    assert_eq!(prefix.len(), 34);
    // `<|im_start|>system\n ... <|im_end|>\n<|im_start|>user\n`
    assert_eq!(prefix[..3], [QWEN2_IM_START, 8948, 198]);
    assert_eq!(prefix[29..], [QWEN2_IM_END, 198, QWEN2_IM_START, 872, 198]);
    let t = tok.encode_qwen_image("a photo of a cat").unwrap();
    assert_eq!(t.ids[..34], prefix[..]);
    assert_eq!(t.ids[34..39], [64, 6548, 315, 264, 8251]);
    assert_eq!(tok.encode("<|endoftext|>").unwrap(), vec![QWEN2_ENDOFTEXT]);
    assert_eq!(tok.decode(&t.ids).unwrap().len(), {
        let text = format!(
            "{}a photo of a cat{}",
            QWEN_IMAGE_TEMPLATE.prefix, QWEN_IMAGE_TEMPLATE.suffix
        );
        text.len()
    });
}

#[test]
fn merges_of_the_wrong_count_are_a_clear_error() {
    let err = QwenTokenizer::from_merges("#version: 0.2\nĠ Ġ\ni n\n", "test merges")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("test merges") && err.contains("2 merges"),
        "{err}"
    );
    let err = QwenTokenizer::from_merges("nospace\n", "bad")
        .unwrap_err()
        .to_string();
    assert!(err.contains("not a pair"), "{err}");
}
