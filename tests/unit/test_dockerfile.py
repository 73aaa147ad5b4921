"""The Dockerfile parser: continuations, forms, substitution, and typed refusals."""

import pytest

from dsec.images.dockerfile import pairs, parse, sources_and_dest, substitute
from dsec.protocol.errors import InvalidRequest, NotSupported


def test_instructions_continuations_and_comments():
    text = """# a comment
FROM debian-minbase
RUN apt-get update && \\
    # a comment inside a continuation
    echo done
EXPOSE 80
COPY ["a b", "/dst/"]
CMD ["python", "-m", "app"]
"""
    found = parse(text)
    assert [i.keyword for i in found] == ["FROM", "RUN", "COPY", "CMD"]
    assert found[1].args == "apt-get update && echo done"
    assert found[1].line == 3
    assert found[2].argv == ("a b", "/dst/")
    assert sources_and_dest(found[2]) == (["a b"], "/dst/")
    assert found[3].argv == ("python", "-m", "app")


def test_escape_directive():
    found = parse("# escape=`\nFROM base\nRUN echo a `\n  b\n")
    assert found[1].args == "echo a b"


def test_arg_and_env_substitution():
    text = """ARG BASE=debian-minbase
FROM $BASE
ARG VERSION=1
ENV APP=/opt/app${VERSION} EMPTY=
WORKDIR ${APP}/src
COPY x ${APP:-/nope}/x
LABEL v=${MISSING:-fallback} w=${APP:+set}
RUN echo $APP
"""
    found = parse(text, {"VERSION": "2"})
    assert found[1].args == "debian-minbase"
    assert pairs(found[3]) == [("APP", "/opt/app2"), ("EMPTY", "")]
    assert found[4].args == "/opt/app2/src"
    assert sources_and_dest(found[5]) == (["x"], "/opt/app2/x")
    assert pairs(found[6]) == [("v", "fallback"), ("w", "set")]
    assert found[7].args == "echo $APP"  # the shell substitutes in RUN, not the parser


def test_legacy_env_form_and_escaped_dollar():
    found = parse("FROM b\nENV GREETING hello there\nENV P=\\$HOME\n")
    assert pairs(found[1]) == [("GREETING", "hello there")]
    assert substitute("\\$HOME", {"HOME": "/root"}) == "$HOME"
    assert pairs(found[2]) == [("P", "$HOME")]


def test_cache_text_tells_forms_and_flags_apart():
    a, b, c = parse("FROM b\nRUN [\"echo\", \"x\"]\nRUN echo x\nCOPY --chown=1:1 a /a\n")[1:]
    assert a.text != b.text
    assert "--chown=1:1" in c.text
    spaced, single = parse("FROM b\nRUN printf 'a  b'\nRUN printf 'a b'\n")[1:]
    assert spaced.text == "RUN printf 'a  b'" != single.text  # a command's spaces are its own


@pytest.mark.parametrize("text, error", [
    ("RUN echo\n", InvalidRequest),  # before FROM
    ("", InvalidRequest),
    ("FROM a\nFROM b\n", NotSupported),
    ("FROM a AS build\n", NotSupported),
    ("FROM a\nFROB x\n", InvalidRequest),
    ("FROM a\nSHELL [\"/bin/bash\", \"-c\"]\n", NotSupported),
    ("FROM a\nCOPY --from=build /x /y\n", NotSupported),
    ("FROM a\nCOPY onlyone\n", InvalidRequest),
    ("FROM a\nENV 1bad=x\n", InvalidRequest),
    ("FROM a\nRUN\n", InvalidRequest),
    ("FROM a\nUSER -c\n", InvalidRequest),
    ("FROM a\nUSER bob alice\n", InvalidRequest),
    ("FROM a\nCOPY --chown a b\n", InvalidRequest),
])
def test_refused_with_a_typed_error(text, error):
    with pytest.raises(error):
        found = parse(text)
        for instruction in found:
            if instruction.keyword in ("COPY", "ADD"):
                sources_and_dest(instruction)
            if instruction.keyword in ("ENV", "LABEL"):
                pairs(instruction)


def test_the_base_images_env_is_substituted_after_from():
    found = parse("FROM b\nENV PATH=/opt/venv/bin:$PATH\n", base_env={"PATH": "/usr/bin:/bin"})
    assert pairs(found[1]) == [("PATH", "/opt/venv/bin:/usr/bin:/bin")]
