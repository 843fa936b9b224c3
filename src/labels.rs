//! One list per table: [`labelled_enum!`] turns a list of `Variant = value => "label"` into
//! the enum with those fixed discriminants, `ALL` (discriminant order), `as_str` (the metric
//! label) and `c_label` (the same label NUL-terminated, for the C name functions), so no table
//! spells its variants twice. The C enums of `include/kvrelay.h` stay literal (cbindgen reads
//! them as they are); `tests/header.rs` checks that they agree with these lists.

/// See the module docs.
macro_rules! labelled_enum {
    (
        $(#[$meta:meta])*
        $vis:vis enum $name:ident: $repr:ty {
            $( $(#[$vmeta:meta])* $variant:ident = $value:literal => $label:literal, )+
        }
    ) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        #[repr($repr)]
        $vis enum $name {
            $( $(#[$vmeta])* $variant = $value, )+
        }

        impl $name {
            /// Every variant, in discriminant order.
            pub const ALL: [$name; [$($value),+].len()] = [$($name::$variant),+];

            /// The label used in metrics, logs and the CLI.
            pub fn as_str(self) -> &'static str {
                match self {
                    $( $name::$variant => $label, )+
                }
            }

            /// The label, NUL-terminated (static; for the C name functions).
            pub fn c_label(self) -> &'static [u8] {
                match self {
                    $( $name::$variant => concat!($label, "\0").as_bytes(), )+
                }
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}

pub(crate) use labelled_enum;
