// Syntax highlighting without a library: one regular expression per language, its named groups the
// classes. highlight(code, lang) -> [[start, end, cls], ...] ascending, non-overlapping (UTF-16 offsets).

const PY_KEYWORDS = 'False None True and as assert async await break class continue def del elif else except ' +
  'finally for from global if import in is lambda match case nonlocal not or pass raise return try while with yield';
const PY_BUILTINS = 'abs all any bool bytes callable chr dict dir enumerate filter float format getattr hasattr ' +
  'hash id input int isinstance issubclass iter len list map max min next object open ord pow print property ' +
  'range repr reversed round set setattr slice sorted staticmethod classmethod str sum super tuple type vars zip self cls';
const JS_KEYWORDS = 'break case catch class const continue debugger default delete do else export extends finally ' +
  'for function if import in instanceof let new return super switch this throw try typeof var void while with ' +
  'yield async await of static public private protected interface type enum implements fn pub mut impl struct ' +
  'use mod match loop where trait func package go defer chan select map range int long short char float double ' +
  'bool boolean void unsigned signed auto sizeof typedef namespace template typename virtual override null true ' +
  'false nil None undefined NULL';
const SH_KEYWORDS = 'if then else elif fi for while until do done case esac function in return export local ' +
  'echo cd set unset source exit';

const words = (list) => `\\b(?:${list.split(' ').join('|')})\\b`;
const NUMBER = String.raw`\b(?:0[xX][0-9a-fA-F_]+|\d[\d_]*(?:\.\d*)?(?:[eE][+-]?\d+)?[jJlLfFuU]*)\b`;

const RULES = {
  python: [
    ['comment', String.raw`#[^\n]*`],
    ['string', String.raw`(?:\b[rRbBfFuU]{1,2})?(?:"""[\s\S]*?(?:"""|$)|'''[\s\S]*?(?:'''|$)|"(?:[^"\\\n]|\\.)*"?|'(?:[^'\\\n]|\\.)*'?)`],
    ['decorator', String.raw`@[A-Za-z_][\w.]*`],
    ['defname', String.raw`(?<=\b(?:def|class)\s+)[A-Za-z_]\w*`],
    ['keyword', words(PY_KEYWORDS)],
    ['builtin', words(PY_BUILTINS)],
    ['number', NUMBER],
  ],
  clike: [
    ['comment', String.raw`\/\/[^\n]*|\/\*[\s\S]*?(?:\*\/|$)`],
    ['string', String.raw`"(?:[^"\\\n]|\\.)*"?|'(?:[^'\\\n]|\\.)*'?|\`(?:[^\`\\]|\\.)*\`?`],
    ['defname', String.raw`(?<=\b(?:function|class|fn|func|def|struct|interface|enum|trait)\s+)[A-Za-z_$][\w$]*`],
    ['keyword', words(JS_KEYWORDS)],
    ['number', NUMBER],
  ],
  shell: [
    ['comment', String.raw`(?<![\w$])#[^\n]*`],
    ['string', String.raw`"(?:[^"\\]|\\.)*"?|'[^']*'?`],
    ['variable', String.raw`\$\{?[A-Za-z_]\w*\}?`],
    ['keyword', words(SH_KEYWORDS)],
    ['number', NUMBER],
  ],
  json: [
    ['property', String.raw`"(?:[^"\\\n]|\\.)*"(?=\s*:)`],
    ['string', String.raw`"(?:[^"\\\n]|\\.)*"?`],
    ['keyword', words('true false null')],
    ['number', String.raw`-?\b\d+(?:\.\d+)?(?:[eE][+-]?\d+)?\b`],
  ],
  generic: [
    ['comment', String.raw`(?<![\w:])(?:#|\/\/)[^\n]*`],
    ['string', String.raw`"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*'`],
    ['number', NUMBER],
  ],
};

const ALIASES = {
  python: 'python', py: 'python', python3: 'python', pycon: 'python',
  js: 'clike', javascript: 'clike', ts: 'clike', typescript: 'clike', jsx: 'clike', tsx: 'clike', java: 'clike',
  c: 'clike', h: 'clike', cpp: 'clike', 'c++': 'clike', cc: 'clike', rust: 'clike', rs: 'clike', go: 'clike',
  cs: 'clike', csharp: 'clike', kotlin: 'clike', swift: 'clike', php: 'clike',
  sh: 'shell', bash: 'shell', shell: 'shell', zsh: 'shell', console: 'shell',
  json: 'json', jsonc: 'json',
};

const compiled = {};

function pattern(lang) {
  if (!compiled[lang]) {
    const rules = RULES[lang];
    const source = rules.map(([name, re]) => `(?<${name}>${re})`).join('|');
    compiled[lang] = { re: new RegExp(source, 'g'), names: rules.map(([name]) => name) };
  }
  return compiled[lang];
}

export function languageOf(tag) {
  return ALIASES[(tag || '').trim().toLowerCase()] || 'generic';
}

export function highlight(code, lang) {
  const { re, names } = pattern(lang in RULES ? lang : languageOf(lang));
  const ranges = [];
  re.lastIndex = 0;
  let match;
  while ((match = re.exec(code)) !== null) {
    if (match[0].length === 0) { re.lastIndex += 1; continue; }
    const name = names.find((n) => match.groups[n] !== undefined);
    ranges.push([match.index, match.index + match[0].length, `hl-${name}`]);
  }
  return ranges;
}
