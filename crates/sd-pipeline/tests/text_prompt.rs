//! Prompt attention parsing (A1111 / stable-diffusion.cpp syntax).

use std::sync::OnceLock;

use proptest::prelude::*;
use sd_pipeline::prompt::{parse_prompt_attention, PromptPart};
use sd_pipeline::tokenizer::{ClipTokenizer, CHUNK_LEN};

fn t(text: &str, weight: f64) -> (Option<String>, f64) {
    (Some(text.to_string()), weight)
}

fn tokenizer() -> &'static ClipTokenizer {
    static TOK: OnceLock<ClipTokenizer> = OnceLock::new();
    TOK.get_or_init(ClipTokenizer::sd1)
}

const BREAK: (Option<String>, f64) = (None, 0.0);

fn check(prompt: &str, expected: &[(Option<String>, f64)]) {
    let got = parse_prompt_attention(prompt);
    assert_eq!(got.len(), expected.len(), "{prompt:?}: {got:?}");
    for (g, e) in got.iter().zip(expected) {
        match (g, e) {
            (PromptPart::Text { text, weight }, (Some(et), ew)) => {
                assert_eq!(text, et, "{prompt:?}: {got:?}");
                assert!(
                    (f64::from(*weight) - ew).abs() < 1e-6,
                    "{prompt:?}: weight {weight} vs {ew}"
                );
            }
            (PromptPart::Break, (None, _)) => {}
            _ => panic!("{prompt:?}: {got:?} vs {expected:?}"),
        }
    }
}

#[test]
fn reference_examples() {
    // The examples documented by A1111's and stable-diffusion.cpp's parse_prompt_attention.
    check("normal text", &[t("normal text", 1.0)]);
    check(
        "an (important) word",
        &[t("an ", 1.0), t("important", 1.1), t(" word", 1.0)],
    );
    check("(unbalanced", &[t("unbalanced", 1.1)]);
    check("\\(literal\\]", &[t("(literal]", 1.0)]);
    check("(unnecessary)(parens)", &[t("unnecessaryparens", 1.1)]);
    check(
        "a (((house:1.3)) [on] a (hill:0.5), sun, (((sky))).",
        &[
            t("a ", 1.0),
            t("house", 1.573),
            t(" ", 1.1),
            t("on", 1.0),
            t(" a ", 1.1),
            t("hill", 0.55),
            t(", sun, ", 1.1),
            t("sky", 1.4641),
            t(".", 1.1),
        ],
    );
}

#[test]
fn nesting_and_numbers() {
    check("((word))", &[t("word", 1.21)]);
    check("(((word)))", &[t("word", 1.331)]);
    check("[word]", &[t("word", 1.0 / 1.1)]);
    check("[[word]]", &[t("word", 1.0 / 1.21)]);
    check("([word])", &[t("word", 1.0)]);
    check("(word:1.5)", &[t("word", 1.5)]);
    check("(word: 0.25 )", &[t("word", 0.25)]);
    check("(word:-1)", &[t("word", -1.0)]);
    check("(word:+.5)", &[t("word", 0.5)]);
    check("((a:2) b)", &[t("a", 2.2), t(" b", 1.1)]);
    check(
        "(a (b:0.5) c:2)",
        &[t("a ", 2.0), t("b", 1.0), t(" c", 2.0)],
    );
}

#[test]
fn literals_and_escapes() {
    check("a:b", &[t("a:b", 1.0)]);
    check("time 12:30", &[t("time 12:30", 1.0)]);
    check("closing) only]", &[t("closing) only]", 1.0)]);
    check("word:1.5)", &[t("word:1.5)", 1.0)]);
    // A weight that is not a number stays literal; the open bracket then applies 1.1.
    check("(a:1.2.3)", &[t("a:1.2.3)", 1.1)]);
    check("\\\\ and \\)", &[t("\\ and )", 1.0)]);
    check("C:\\path", &[t("C:\\path", 1.0)]);
    check("trailing \\", &[t("trailing \\", 1.0)]);
    check("", &[t("", 1.0)]);
    check("()", &[t("", 1.0)]);
    check("[(:)]", &[t(":", 1.0)]);
}

#[test]
fn breaks() {
    check("a BREAK b", &[t("a", 1.0), BREAK, t("b", 1.0)]);
    check("a\nBREAK\nb", &[t("a", 1.0), BREAK, t("b", 1.0)]);
    check("aBREAK b", &[t("aBREAK b", 1.0)]);
    check("a BREAKING b", &[t("a BREAKING b", 1.0)]);
    check("a break b", &[t("a break b", 1.0)]);
    check("a,BREAK,b", &[t("a,", 1.0), BREAK, t(",b", 1.0)]);
    check("BREAK", &[BREAK]);
    check("(a BREAK b)", &[t("a", 1.1), BREAK, t("b", 1.1)]);
    check("a BREAK BREAK b", &[t("a", 1.0), BREAK, BREAK, t("b", 1.0)]);
}

fn prompt_strategy() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<String>(),
        proptest::collection::vec(
            prop_oneof![
                Just("(".to_string()),
                Just(")".to_string()),
                Just("[".to_string()),
                Just("]".to_string()),
                Just("\\".to_string()),
                Just(":".to_string()),
                Just(" BREAK ".to_string()),
                Just("BREAK".to_string()),
                Just(":1.5)".to_string()),
                Just(":-.)".to_string()),
                Just("<|endoftext|>".to_string()),
                Just("<start_of_text>".to_string()),
                "[a-z0-9 .,éü日]{0,6}",
            ],
            0..40
        )
        .prop_map(|v| v.concat()),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn parse_and_tokenize_never_panic(prompt in prompt_strategy()) {
        let parts = parse_prompt_attention(&prompt);
        prop_assert!(!parts.is_empty());
        for p in &parts {
            if let PromptPart::Text { text, .. } = p {
                prop_assert!(!text.is_empty() || parts.len() == 1);
            }
        }
        let tok = tokenizer();
        let t = tok.tokenize_weighted(&prompt);
        prop_assert!(t.num_chunks() >= 1);
        prop_assert_eq!(t.tokens().len(), t.num_chunks() * CHUNK_LEN);
        prop_assert_eq!(t.tokens().len(), t.weights().len());
        let _ = tok.decode(t.tokens());
    }

    #[test]
    fn plain_text_is_one_neutral_piece(prompt in "[a-zA-Z0-9 ,.!?]{1,50}") {
        let parts = parse_prompt_attention(&prompt);
        if !prompt.split(|c: char| !c.is_alphanumeric() && c != '_').any(|w| w == "BREAK") {
            prop_assert_eq!(parts, vec![PromptPart::text(prompt.clone(), 1.0)]);
        }
    }
}
