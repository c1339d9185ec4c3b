"""The live dashboard's static files (index.html, app.js, style.css), served by the controller."""
