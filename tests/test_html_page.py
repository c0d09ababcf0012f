"""The page skeleton the results page, the logit lens's page and the attention view share."""

from ember.experiments.attention_view import attention_html
from ember.experiments.lens_view import lens_html
from ember.html_page import html_page
from ember.studies.report import ResultsPage, render


def test_the_title_is_escaped_and_the_body_kept_as_markup():
    page = html_page("a <b> & 'c'", "p { color: red }", "<p>kept</p>")
    assert page.startswith("<!doctype html>\n") and page.endswith("</html>\n")
    assert page.count("a &lt;b&gt; &amp; &#x27;c&#x27;") == 2  # <title> and <h1>
    assert "<style>p { color: red }</style>" in page and "<p>kept</p>\n</body>" in page


def test_every_page_uses_it():
    for page, title in ((lens_html([], title="lens <1>"), "lens <1>"),
                        (attention_html([], [], title="heads <2>"), "heads <2>"),
                        (render(ResultsPage(title="study <3>", facts=[])), "study <3>")):
        head = page[:page.index("<style>")]
        assert head == html_page(title, "", "")[:len(head)], head
        assert page.count(f"<h1>{title.replace('<', '&lt;').replace('>', '&gt;')}</h1>") == 1
