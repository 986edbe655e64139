//! Nominal feature keys (SPEC S3.9): a key is a hash of (field, raw value), so
//! no contiguous ID range is needed and fields never collide.

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Salt so that a field index alone never equals a plain xxh3 seed a user might pick.
const KEY_SALT: u64 = 0x5350_4152_524f_5721;

/// The u64 key of raw value `value` in field `field`. An empty value is a
/// legitimate key ("missing in this field"), distinct per field.
#[inline]
pub fn feature_key(field: u32, value: &[u8]) -> u64 {
    xxh3_64_with_seed(value, KEY_SALT ^ (u64::from(field) << 32))
}

/// A fast 64-bit mixer (murmur3 finalizer): spreads a key's bits so that shard
/// selection and in-shard bucket selection use independent-looking bits.
#[inline]
pub fn mix64(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^= x >> 33;
    x
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_value_in_different_fields_gives_different_keys() {
        assert_ne!(feature_key(0, b"68fd1e64"), feature_key(1, b"68fd1e64"));
        assert_eq!(feature_key(3, b"abc"), feature_key(3, b"abc"));
        assert_ne!(feature_key(3, b""), feature_key(4, b""));
    }
}
