//! Shared-token checks, the same for every endpoint that takes one (the
//! roles' RPCs, their metrics endpoints, `sparrow serve`): the token is
//! compared in constant time, so how long a refusal takes tells nothing of
//! how much of a guess was right.

/// Whether `given` equals `expected`, in time that depends only on the
/// lengths (no early exit at the first differing byte).
pub fn same_token(given: &[u8], expected: &[u8]) -> bool {
    let mut differ = u8::from(given.len() != expected.len());
    for (i, &e) in expected.iter().enumerate() {
        // A shorter guess is compared against zeros: every byte of the
        // token is read whatever the guess.
        differ |= e ^ given.get(i).copied().unwrap_or(0);
    }
    differ == 0
}

/// Refuses a token that a request cannot carry as `Authorization: Bearer
/// TOKEN` (every endpoint would then answer 401, and gRPC metadata refuses
/// it): only visible ASCII, no space, tab, line break or other byte.
/// `source` names where it came from (the variable or the key).
pub fn check(token: &str, source: &str) -> Result<(), String> {
    match token.bytes().position(|b| !b.is_ascii_graphic()) {
        None => Ok(()),
        Some(at) => Err(format!(
            "{source}: the token holds {} at byte {at}, which a request's `Authorization: Bearer` header cannot \
             carry: use visible ASCII only (letters, digits, -._~+/=)",
            match token.as_bytes()[at] {
                b' ' => "a space".to_string(),
                b'\t' => "a tab".to_string(),
                b'\n' | b'\r' => "a line break".to_string(),
                b => format!("byte 0x{b:02x}"),
            }
        )),
    }
}

/// Whether an `Authorization` header's value carries `expected` as a bearer
/// token (`Bearer TOKEN`; the scheme's case is not significant, RFC 9110).
pub fn bearer_matches(header: Option<&[u8]>, expected: &str) -> bool {
    let Some(value) = header else { return false };
    let Some((scheme, token)) = value.split_at_checked(7) else { return false };
    scheme.eq_ignore_ascii_case(b"Bearer ") && same_token(token, expected.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_match_only_when_equal() {
        assert!(same_token(b"s3cret", b"s3cret"));
        assert!(!same_token(b"s3cres", b"s3cret"));
        assert!(!same_token(b"s3cre", b"s3cret"), "a prefix");
        assert!(!same_token(b"s3cret!", b"s3cret"), "longer");
        assert!(!same_token(b"", b"s3cret"));
        assert!(!same_token(b"s3cret\0", b"s3cret"));
    }

    #[test]
    fn tokens_a_header_cannot_carry_are_refused_by_source() {
        assert!(check("s3cret-Token_1.~+/=", "SPARROW_AUTH_TOKEN").is_ok());
        for (token, what) in
            [("abc\n", "a line break at byte 3"), (" ", "a space at byte 0"), ("a\tb", "a tab"), ("é", "0xc3")]
        {
            let e = check(token, "SPARROW_AUTH_TOKEN").expect_err(token);
            assert!(e.starts_with("SPARROW_AUTH_TOKEN: ") && e.contains(what), "{e}");
        }
    }

    #[test]
    fn bearer_headers() {
        assert!(bearer_matches(Some(b"Bearer t0k"), "t0k"));
        assert!(bearer_matches(Some(b"bearer t0k"), "t0k"));
        assert!(!bearer_matches(Some(b"Bearer t0"), "t0k"));
        assert!(!bearer_matches(Some(b"Basic t0k"), "t0k"));
        assert!(!bearer_matches(Some(b"t0k"), "t0k"));
        assert!(!bearer_matches(None, "t0k"));
    }
}
