"""SS001 syntax-error: the spec does not parse. The finding points at the offending token,
names the tokens that were expected, and never shows a traceback."""

CASES = [
    {
        "name": "missing colon in mesh",
        "spec": """
            mesh over 8 ranks {
                dp_shard: *
                tp 2
            }
            """,
        "expect": [("SS001", 3, "unexpected '2'", "2", "expected ':'")],
    },
    {
        "name": "mesh written right",
        "spec": """
            mesh over 8 ranks {
                dp_shard: *
                tp: 2
            }
            """,
        "expect": [],
    },
    {
        "name": "shard on instead of over",
        "spec": """
            mesh over 8 ranks { dp_shard: *  tp: 2 }
            param w [out, in] {
                shard out on tp
            }
            """,
        "expect": [("SS001", 3, "unexpected 'on'", "on", "expected 'over'")],
    },
    {
        "name": "shard over",
        "spec": """
            mesh over 8 ranks { dp_shard: *  tp: 2 }
            param w [out, in] {
                shard out over tp
            }
            """,
        "expect": [],
    },
    {
        "name": "missing dimension list",
        "spec": """
            mesh over 8 ranks { dp_shard: *  tp: 2 }
            param w shard out over tp
            """,
        "expect": [("SS001", 2, "unexpected 'shard'", "shard", "'['")],
    },
    {
        "name": "unclosed brace",
        "spec": """
            mesh over 8 ranks { dp_shard: *  tp: 2 }
            param w [out, in] {
                shard out over tp
            """,
        "expect": [("SS001", 3, "unexpected end of file", "", "'}'")],
    },
    {
        "name": "stray closing brace",
        "spec": """
            mesh over 8 ranks { dp_shard: *  tp: 2 }
            param w [out, in] {
                shard out over tp
            }
            }
            """,
        "expect": [("SS001", 5, "unexpected '}'", "}", "'param'")],
    },
    {
        "name": "several axes without parentheses",
        "spec": """
            mesh over 8 ranks { dp_shard: *  tp: 2 }
            param w [out, in] {
                shard out over tp, dp_shard
            }
            """,
        "expect": [("SS001", 3, "unexpected ','", ",", "'shard'")],
    },
    {
        "name": "several axes in parentheses",
        "spec": """
            mesh over 8 ranks { dp_shard: *  tp: 2 }
            param w [out, in] {
                shard out over (tp, dp_shard)
            }
            """,
        "expect": [],
    },
    {
        "name": "mesh size is not a number",
        "spec": """
            mesh over 8 ranks { dp_shard: *  tp: two }
            """,
        "expect": [("SS001", 1, "unexpected 'two'", "two", "a whole number")],
    },
    {
        "name": "unterminated string",
        "spec": """
            manifest "m.json
            mesh over 8 ranks { dp_shard: * }
            """,
        "expect": [("SS001", 1, "unexpected character '\"'", '"')],
    },
    {
        "name": "missing pattern",
        "spec": """
            mesh over 8 ranks { dp_shard: * }
            param [x] {}
            """,
        "expect": [("SS001", 2, "unexpected '['", "[", "a parameter pattern")],
    },
    {
        "name": "pad misspelled on an hf map line",
        "spec": """
            hf {
                a.weight -> b.weight padd 0 to 64
            }
            """,
        "expect": [("SS001", 2, "unexpected '0'", "0", "did you mean `pad`?")],
    },
    {
        "name": "pad names its dimension by index or name, not by a sign",
        "spec": """
            hf {
                a.weight -> b.weight pad -1 to 64
            }
            """,
        "expect": [("SS001", 2, "unexpected", "-", "the rule's name for it")],
    },
    {
        "name": "pad without `to`",
        "spec": """
            hf {
                a.weight -> b.weight pad 0 64
            }
            """,
        "expect": [("SS001", 2, "unexpected '64'", "64", "write `pad D to M`")],
    },
    {
        "name": "pad's axis factor written with `*`",
        "spec": """
            hf {
                a.weight -> b.weight pad 0 to 128 * tp
            }
            """,
        "expect": [("SS001", 2, "unexpected 'tp'", "tp", "`x AXIS`")],
    },
]
