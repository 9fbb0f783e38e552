//! Integer fields of request bodies as JSON Schema counts them: `"type": "integer"` holds every number whose fraction
//! is zero, so `3.0` is the integer `3` and the API takes it like `3` (serde alone refuses `3.0` for an integer type).
//! Use with `#[serde(deserialize_with = "whole_number::deserialize")]` (or `whole_number::optional` for an
//! `Option`, where `null` is `None`).

use std::fmt;
use std::marker::PhantomData;

use serde::Deserializer;
use serde::de::{self, Unexpected};

/// A non-negative integer that fits `T`, written `3` or `3.0`.
pub fn deserialize<'de, D, T>(deserializer: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: TryFrom<u64>,
{
    deserializer.deserialize_any(Whole(PhantomData))
}

/// Like [`deserialize`], with `null` (or an absent field, given `#[serde(default)]`) as `None`.
pub fn optional<'de, D, T>(deserializer: D) -> Result<Option<T>, D::Error>
where
    D: Deserializer<'de>,
    T: TryFrom<u64>,
{
    deserializer.deserialize_option(Optional(PhantomData))
}

struct Whole<T>(PhantomData<T>);

impl<T: TryFrom<u64>> de::Visitor<'_> for Whole<T> {
    type Value = T;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a non-negative integer in range")
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<T, E> {
        T::try_from(v).map_err(|_| E::invalid_value(Unexpected::Unsigned(v), &self))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<T, E> {
        let unsigned = u64::try_from(v).map_err(|_| E::invalid_value(Unexpected::Signed(v), &self))?;
        self.visit_u64(unsigned)
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<T, E> {
        // 2^64 is the first f64 above u64::MAX; below it, a whole number converts exactly.
        if v.fract() == 0.0 && (0.0..18_446_744_073_709_551_616.0).contains(&v) {
            return self.visit_u64(v as u64);
        }
        Err(E::invalid_value(Unexpected::Float(v), &self))
    }
}

struct Optional<T>(PhantomData<T>);

impl<'de, T: TryFrom<u64>> de::Visitor<'de> for Optional<T> {
    type Value = Option<T>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a non-negative integer in range, or null")
    }

    fn visit_none<E: de::Error>(self) -> Result<Option<T>, E> {
        Ok(None)
    }

    fn visit_unit<E: de::Error>(self) -> Result<Option<T>, E> {
        Ok(None)
    }

    fn visit_some<D: Deserializer<'de>>(self, deserializer: D) -> Result<Option<T>, D::Error> {
        deserialize(deserializer).map(Some)
    }
}

#[cfg(test)]
mod tests {
    use serde::Deserialize;

    #[derive(Deserialize)]
    struct Body {
        #[serde(deserialize_with = "super::deserialize")]
        size: u32,
        #[serde(default, deserialize_with = "super::optional")]
        words: Option<u32>,
    }

    fn parse(json: &str) -> Result<Body, serde_json::Error> {
        serde_json::from_str(json)
    }

    #[test]
    fn a_number_with_a_zero_fraction_is_an_integer() {
        let body = parse(r#"{"size": 3.0, "words": 2e1}"#).unwrap();
        assert_eq!((body.size, body.words), (3, Some(20)));
        let body = parse(r#"{"size": 0}"#).unwrap();
        assert_eq!((body.size, body.words), (0, None));
        assert_eq!(parse(r#"{"size": 1, "words": null}"#).unwrap().words, None);
    }

    #[test]
    fn fractions_negatives_and_out_of_range_numbers_are_refused() {
        for json in [
            r#"{"size": 1.5}"#,
            r#"{"size": -1}"#,
            r#"{"size": -0.5}"#,
            r#"{"size": 4294967296}"#,
            r#"{"size": 1e300}"#,
            r#"{"size": "1"}"#,
            r#"{"size": null}"#,
            r#"{"size": 1, "words": 2.5}"#,
        ] {
            assert!(parse(json).is_err(), "{json}");
        }
    }
}
