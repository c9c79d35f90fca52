//! `<lora:NAME:WEIGHT>` prompt tags (stable-diffusion.cpp's syntax): taken out of the prompt
//! and applied through the residency manager's LoRA support (`ModelManager::set_loras`).

use std::path::{Path, PathBuf};

use sd_residency::LoraSpec;

/// File extensions tried for a LoRA name, in order (stable-diffusion.cpp's).
const EXTENSIONS: [&str; 4] = ["safetensors", "ckpt", "pt", "gguf"];

/// Removes every `<lora:NAME:WEIGHT>` tag from `prompt`; returns the prompt without them and
/// the `(NAME, WEIGHT)` pairs in order (a name given twice has its weights summed). A tag
/// without a weight, or with one that is not a number, is an error.
pub fn extract(prompt: &str) -> Result<(String, Vec<(String, f32)>), String> {
    let mut out = String::with_capacity(prompt.len());
    let mut loras: Vec<(String, f32)> = Vec::new();
    let mut rest = prompt;
    while let Some(start) = rest.find("<lora:") {
        out.push_str(&rest[..start]);
        let tag = &rest[start + 6..];
        let end = tag
            .find('>')
            .ok_or_else(|| format!("unclosed LoRA tag '{}'", &rest[start..]))?;
        let body = &tag[..end];
        let (name, weight) = body.rsplit_once(':').ok_or_else(|| {
            format!("LoRA tag '<lora:{body}>' needs a weight: <lora:NAME:WEIGHT>")
        })?;
        let w: f32 = weight
            .trim()
            .parse()
            .ok()
            .filter(|w: &f32| w.is_finite())
            .ok_or_else(|| format!("LoRA tag '<lora:{body}>': '{weight}' is not a number"))?;
        let name = name.trim();
        if name.is_empty() {
            return Err(format!("LoRA tag '<lora:{body}>' names no file"));
        }
        match loras.iter_mut().find(|(n, _)| n == name) {
            Some((_, sum)) => *sum += w,
            None => loras.push((name.to_string(), w)),
        }
        rest = &tag[end + 1..];
    }
    out.push_str(rest);
    Ok((out, loras))
}

/// The file of LoRA `name` in `dir`: `dir/name` when it exists as given, else with one of
/// the known extensions.
pub fn resolve(dir: &Path, name: &str) -> Result<PathBuf, String> {
    let direct = dir.join(name);
    if direct.is_file() {
        return Ok(direct);
    }
    for ext in EXTENSIONS {
        let p = dir.join(format!("{name}.{ext}"));
        if p.is_file() {
            return Ok(p);
        }
    }
    Err(format!(
        "LoRA '{name}': no {}/{name}.{{{}}}",
        dir.display(),
        EXTENSIONS.join(",")
    ))
}

/// The LoRA specs of the prompt's tags, with their files in `dir`.
pub fn specs(dir: &Path, tags: &[(String, f32)]) -> Result<Vec<LoraSpec>, String> {
    tags.iter()
        .map(|(name, w)| {
            Ok(LoraSpec {
                path: resolve(dir, name)?,
                multiplier: *w,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_are_taken_out() {
        let (p, l) =
            extract("a cat <lora:styleA:0.8>, <lora:sub/b:1> and <lora:styleA:0.2>").unwrap();
        assert_eq!(p, "a cat ,  and ");
        assert_eq!(
            l,
            vec![("styleA".to_string(), 1.0), ("sub/b".to_string(), 1.0)]
        );
        assert_eq!(extract("plain").unwrap(), ("plain".to_string(), vec![]));
        assert!(extract("<lora:x>").is_err());
        assert!(extract("<lora:x:abc>").is_err());
        assert!(extract("<lora:x:1").is_err());
    }
}
