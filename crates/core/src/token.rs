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
    fn bearer_headers() {
        assert!(bearer_matches(Some(b"Bearer t0k"), "t0k"));
        assert!(bearer_matches(Some(b"bearer t0k"), "t0k"));
        assert!(!bearer_matches(Some(b"Bearer t0"), "t0k"));
        assert!(!bearer_matches(Some(b"Basic t0k"), "t0k"));
        assert!(!bearer_matches(Some(b"t0k"), "t0k"));
        assert!(!bearer_matches(None, "t0k"));
    }
}
