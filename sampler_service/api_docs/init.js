// The API reference, from the sampler's own OpenAPI document. Nothing is fetched from
// another origin: no validator badge, no fonts, no favicon.
"use strict";

document.addEventListener("DOMContentLoaded", () => {
  window.ui = SwaggerUIBundle({
    url: "/openapi.json",
    dom_id: "#swagger-ui",
    deepLinking: true,
    validatorUrl: null,
    presets: [SwaggerUIBundle.presets.apis],
    layout: "BaseLayout",
  });
});
