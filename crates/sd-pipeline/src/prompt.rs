//! Prompt attention syntax, as in AUTOMATIC1111's web UI and stable-diffusion.cpp.
//!
//! [`parse_prompt_attention`] turns a prompt into text pieces with an attention weight each:
//!
//! | syntax        | effect                                           |
//! |---------------|--------------------------------------------------|
//! | `(text)`      | weight × 1.1                                     |
//! | `((text))`    | weight × 1.1² = 1.21                             |
//! | `(text:1.5)`  | weight × 1.5                                     |
//! | `[text]`      | weight ÷ 1.1                                     |
//! | `\(` `\)` `\[` `\]` `\\` | the literal character                 |
//! | `BREAK`       | starts a new 75-token chunk ([`PromptPart::Break`]) |
//!
//! Brackets left open at the end of the prompt still apply their multiplier (to everything after
//! them); closing brackets without an opener are kept as literal text. The parser never fails
//! and never panics: every input string has a parse.
//!
//! Deliberate differences from A1111 (whose behaviour there is accidental):
//! - `BREAK` inside brackets is still a chunk break (A1111 multiplies its marker weight and then
//!   tokenizes the word "BREAK").
//! - A `(text:w)` weight that is not a number (`(a:1.2.3)`) is kept as literal text instead of
//!   raising an exception.
//! - A backslash that escapes nothing is kept (A1111 drops it).

/// One piece of a parsed prompt.
#[derive(Clone, Debug, PartialEq)]
pub enum PromptPart {
    /// Text with its attention weight (1.0 = neutral).
    Text {
        /// The text, escapes resolved.
        text: String,
        /// The attention weight.
        weight: f32,
    },
    /// A `BREAK` keyword: pad the current chunk and start a new one.
    Break,
}

impl PromptPart {
    /// A text part.
    pub fn text(text: impl Into<String>, weight: f32) -> Self {
        PromptPart::Text {
            text: text.into(),
            weight,
        }
    }
}

/// Multiplier of one level of round brackets.
pub const ROUND_BRACKET_MULTIPLIER: f64 = 1.1;
/// Multiplier of one level of square brackets.
pub const SQUARE_BRACKET_MULTIPLIER: f64 = 1.0 / 1.1;

/// A parse entry while brackets are still open; weights in f64 as A1111 (Python floats).
enum Entry {
    Text(String, f64),
    Break,
}

/// Parses the attention syntax of `prompt` into text pieces and breaks.
///
/// Adjacent text pieces of equal weight are merged and empty pieces dropped; a prompt without
/// any text gives a single empty piece of weight 1.0 (unless it holds breaks).
///
/// ```
/// use sd_pipeline::prompt::{parse_prompt_attention, PromptPart};
/// let parts = parse_prompt_attention("an (important) word");
/// assert_eq!(
///     parts,
///     vec![
///         PromptPart::text("an ", 1.0),
///         PromptPart::text("important", 1.1),
///         PromptPart::text(" word", 1.0),
///     ]
/// );
/// ```
pub fn parse_prompt_attention(prompt: &str) -> Vec<PromptPart> {
    let mut res: Vec<Entry> = Vec::new();
    let mut round: Vec<usize> = Vec::new();
    let mut square: Vec<usize> = Vec::new();

    let multiply = |res: &mut Vec<Entry>, start: usize, m: f64| {
        for e in res.iter_mut().skip(start) {
            if let Entry::Text(_, w) = e {
                *w *= m;
            }
        }
    };

    let mut rest = prompt;
    while let Some(c) = rest.chars().next() {
        match c {
            '\\' => {
                let mut it = rest.chars();
                it.next();
                match it.next() {
                    Some(e @ ('(' | ')' | '[' | ']' | '\\')) => {
                        res.push(Entry::Text(e.to_string(), 1.0));
                        rest = &rest[2..];
                    }
                    _ => {
                        res.push(Entry::Text("\\".to_string(), 1.0));
                        rest = &rest[1..];
                    }
                }
            }
            '(' => {
                round.push(res.len());
                rest = &rest[1..];
            }
            '[' => {
                square.push(res.len());
                rest = &rest[1..];
            }
            ')' => {
                match round.pop() {
                    Some(start) => multiply(&mut res, start, ROUND_BRACKET_MULTIPLIER),
                    None => res.push(Entry::Text(")".to_string(), 1.0)),
                }
                rest = &rest[1..];
            }
            ']' => {
                match square.pop() {
                    Some(start) => multiply(&mut res, start, SQUARE_BRACKET_MULTIPLIER),
                    None => res.push(Entry::Text("]".to_string(), 1.0)),
                }
                rest = &rest[1..];
            }
            ':' => match match_weight(rest) {
                Some((len, number)) => {
                    let weight = number.parse::<f64>().ok().filter(|w| w.is_finite());
                    match (weight, round.last().copied()) {
                        (Some(w), Some(start)) => {
                            round.pop();
                            multiply(&mut res, start, w);
                        }
                        _ => push_plain(&mut res, &rest[..len]),
                    }
                    rest = &rest[len..];
                }
                None => {
                    res.push(Entry::Text(":".to_string(), 1.0));
                    rest = &rest[1..];
                }
            },
            _ => {
                let end = rest
                    .find(['\\', '(', ')', '[', ']', ':'])
                    .unwrap_or(rest.len());
                push_plain(&mut res, &rest[..end]);
                rest = &rest[end..];
            }
        }
    }

    for &start in &round {
        multiply(&mut res, start, ROUND_BRACKET_MULTIPLIER);
    }
    for &start in &square {
        multiply(&mut res, start, SQUARE_BRACKET_MULTIPLIER);
    }

    // Drop empty pieces, then merge runs of equal weight.
    let mut out: Vec<(Option<String>, f64)> = Vec::new();
    for e in res {
        match e {
            Entry::Break => out.push((None, 0.0)),
            Entry::Text(t, _) if t.is_empty() => {}
            Entry::Text(t, w) => match out.last_mut() {
                Some((Some(prev), pw)) if *pw == w => prev.push_str(&t),
                _ => out.push((Some(t), w)),
            },
        }
    }
    if out.is_empty() {
        return vec![PromptPart::text("", 1.0)];
    }
    out.into_iter()
        .map(|(t, w)| match t {
            Some(text) => PromptPart::Text {
                text,
                weight: w as f32,
            },
            None => PromptPart::Break,
        })
        .collect()
}

/// Matches `:\s*([+-]?[.\d]+)\s*\)` at the start of `s`: the byte length of the match and the
/// number text.
fn match_weight(s: &str) -> Option<(usize, &str)> {
    let b = s.as_bytes();
    let mut i = 1; // past ':'
    let skip_ws = |mut i: usize| {
        while let Some(c) = s[i..].chars().next() {
            if c.is_whitespace() {
                i += c.len_utf8();
            } else {
                break;
            }
        }
        i
    };
    i = skip_ws(i);
    let num_start = i;
    if matches!(b.get(i), Some(b'+' | b'-')) {
        i += 1;
    }
    let digits_start = i;
    while matches!(b.get(i), Some(b'.' | b'0'..=b'9')) {
        i += 1;
    }
    if i == digits_start {
        return None;
    }
    let num_end = i;
    i = skip_ws(i);
    if b.get(i) == Some(&b')') {
        Some((i + 1, &s[num_start..num_end]))
    } else {
        None
    }
}

/// Pushes plain text, splitting it at `BREAK` keywords (`\s*\bBREAK\b\s*`).
fn push_plain(res: &mut Vec<Entry>, text: &str) {
    let is_word = |c: char| c.is_alphanumeric() || c == '_';
    let mut seg_start = 0;
    let mut search = 0;
    while let Some(rel) = text[search..].find("BREAK") {
        let pos = search + rel;
        let end = pos + "BREAK".len();
        let before_ok = text[..pos].chars().next_back().is_none_or(|c| !is_word(c));
        let after_ok = text[end..].chars().next().is_none_or(|c| !is_word(c));
        if before_ok && after_ok {
            let seg = text[seg_start..pos].trim_end_matches(char::is_whitespace);
            res.push(Entry::Text(seg.to_string(), 1.0));
            res.push(Entry::Break);
            let after = &text[end..];
            seg_start = end + (after.len() - after.trim_start_matches(char::is_whitespace).len());
            search = seg_start;
        } else {
            search = end;
        }
    }
    res.push(Entry::Text(text[seg_start..].to_string(), 1.0));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weight_match() {
        assert_eq!(match_weight(":1.5)"), Some((5, "1.5")));
        assert_eq!(match_weight(": -0.5 )x"), Some((8, "-0.5")));
        assert_eq!(match_weight(":a)"), None);
        assert_eq!(match_weight(":1.5"), None);
        assert_eq!(match_weight(":"), None);
    }
}
